"""Known bad: `seed = seed + rank` then manual_seed(seed): every rank builds different weights, nothing syncs."""

import os

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
seed = 1234
seed = seed + rank
torch.manual_seed(seed)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    loss = model(torch.randn(4, 8)).sum()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
dist.destroy_process_group()
