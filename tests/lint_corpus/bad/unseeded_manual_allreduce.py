"""Known bad: a model averaged by hand (no DDP, no broadcast) and built without a seed: replicas start apart."""

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    model(torch.randn(4, 8)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
