"""Known bad: context managers called as plain statements do nothing (no `with`)."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.accelerator.device_index(local_rank)
torch.manual_seed(0)
model = DDP(nn.Linear(8, 2).to(local_rank), device_ids=[local_rank])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    x = torch.randn(4, 8, device=local_rank)
    if step % 4 != 3:
        model.no_sync()
    model(x).sum().backward()
    if step % 4 == 3:
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
