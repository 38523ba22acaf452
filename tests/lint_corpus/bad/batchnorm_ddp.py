"""Known bad: a BatchNorm model under DDP without SyncBatchNorm (one decision: one finding, not one per layer)."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
torch.manual_seed(0)
net = nn.Sequential(
    nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.BatchNorm2d(16), nn.ReLU()
)
model = DDP(net.cuda(), device_ids=[local_rank])
dist.destroy_process_group()
