"""Known bad: test accuracy printed on rank 0 from its own shard's counts, never all-reduced."""

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
test_set = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
test_loader = DataLoader(test_set, batch_size=32, sampler=DistributedSampler(test_set, shuffle=False))
correct = 0
total = 0
with torch.no_grad():
    for x, y in test_loader:
        pred = model(x.cuda()).argmax(1)
        correct += (pred == y.cuda()).sum().item()
        total += y.numel()
if rank == 0:
    print(f"test accuracy {correct / total:.3f}")
dist.destroy_process_group()
