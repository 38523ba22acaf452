"""Correct: deepspeed.initialize broadcasts rank 0's parameters and shards the training data it is given."""

import os

import deepspeed
import torch
from torch import nn
from torch.utils.data import TensorDataset

local_rank = int(os.environ["LOCAL_RANK"])
deepspeed.init_distributed()
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
engine, optimizer, loader, _ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), training_data=data, config="ds_config.json"
)
for x, y in loader:
    loss = nn.functional.cross_entropy(engine(x.to(engine.device)), y.to(engine.device))
    engine.backward(loss)
    engine.step()
