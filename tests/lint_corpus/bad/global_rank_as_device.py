"""Known bad: the global RANK used as the CUDA device index: wrong on every node but the first."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
torch.manual_seed(0)
model = DDP(nn.Linear(8, 2).to(rank), device_ids=[rank])
dist.destroy_process_group()
