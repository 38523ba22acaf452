"""Correct: rank 0 prints its running training loss as progress (normal logging, not a reported metric)."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("nccl")
rank = dist.get_rank()
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
torch.manual_seed(0)
model = DDP(nn.Linear(8, 2).cuda(), device_ids=[local_rank])
data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=32, sampler=sampler)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    sampler.set_epoch(epoch)
    running_loss = 0.0
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
        running_loss += loss.item()
    if rank == 0:
        print(f"epoch {epoch} train loss {running_loss / len(loader):.3f}")
dist.destroy_process_group()
