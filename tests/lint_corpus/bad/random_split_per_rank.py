"""Known bad: random_split with no seeded generator: every rank trains and tests on a different split."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, random_split

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
full = TensorDataset(torch.randn(1000, 8), torch.randint(0, 2, (1000,)))
train_set, test_set = random_split(full, [800, 200])
model = DDP(nn.Linear(8, 2).cuda(), device_ids=[local_rank])
sampler = DistributedSampler(train_set)
loader = DataLoader(train_set, batch_size=32, sampler=sampler)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y in loader:
        model(x.cuda()).sum().backward()
dist.destroy_process_group()
