"""Known bad: every rank seeds its environment with the same seed: all ranks collect identical rollouts."""

import gymnasium as gym
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
env = gym.make("CartPole-v1")
obs, _ = env.reset(seed=42)
policy = DDP(nn.Linear(4, 2))
for step in range(100):
    action = policy(torch.as_tensor(obs)).argmax().item()
    obs, reward, done, truncated, _ = env.step(action)
    if done or truncated:
        obs, _ = env.reset()
dist.destroy_process_group()
