"""Known bad: a collective only rank 0 reaches: the other ranks never call it and the job hangs."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([float(rank)])
if rank == 0:
    dist.all_reduce(total)
    print(total.item())
dist.destroy_process_group()
