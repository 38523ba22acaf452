"""Known bad: a DataLoader with shuffle=True and no DistributedSampler in a DDP script."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
torch.manual_seed(0)
model = DDP(nn.Linear(8, 2).cuda(), device_ids=[local_rank])
data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
loader = DataLoader(data, batch_size=32, shuffle=True)
for x, y in loader:
    model(x.cuda()).sum().backward()
dist.destroy_process_group()
