"""Known bad: init_process_group(rank=local_rank) under torchrun: on several nodes two processes claim rank 0."""

import os

import torch
import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
torch.cuda.set_device(local_rank)
t = torch.ones(1, device="cuda")
dist.all_reduce(t)
dist.destroy_process_group()
