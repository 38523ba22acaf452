"""Correct: one seed for the model on every rank, a per-rank seed for the environment, a seeded split."""

import os

import gymnasium as gym
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset, random_split

dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
seed = 1234
torch.manual_seed(seed)
policy = DDP(nn.Linear(4, 2))
full = TensorDataset(torch.randn(1000, 4))
train_set, val_set = random_split(full, [900, 100], generator=torch.Generator().manual_seed(seed))
env = gym.make("CartPole-v1")
obs, _ = env.reset(seed=seed + rank)
for step in range(100):
    obs, reward, done, truncated, _ = env.step(policy(torch.as_tensor(obs)).argmax().item())
    if done or truncated:
        obs, _ = env.reset()
dist.destroy_process_group()
