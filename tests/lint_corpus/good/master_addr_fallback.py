"""Correct: torchrun's variables when present, a single-machine default in the fallback branch only."""

import os

import torch
import torch.distributed as dist


def setup() -> int:
    if "RANK" in os.environ:
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
    else:
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = "29500"
        dist.init_process_group("gloo", rank=0, world_size=1)
        local_rank = 0
    return local_rank


local_rank = setup()
torch.cuda.set_device(local_rank)
dist.barrier()
dist.destroy_process_group()
