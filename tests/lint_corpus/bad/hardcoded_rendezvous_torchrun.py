"""Known bad: a literal MASTER_ADDR/MASTER_PORT written over torchrun's in a torchrun script."""

import os

import torch
import torch.distributed as dist

os.environ["MASTER_ADDR"] = "localhost"
os.environ["MASTER_PORT"] = "12355"
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("nccl")
torch.cuda.set_device(local_rank)
dist.barrier()
dist.destroy_process_group()
