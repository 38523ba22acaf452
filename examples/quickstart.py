"""paratrain's Python API in a dozen lines: DDP on scikit-learn digits.

paratrain launch --nproc-per-node 2 examples/quickstart.py     # or: python examples/quickstart.py
"""

import torch
from sklearn.datasets import load_digits
from torch.nn import functional as F

import paratrain
from paratrain.data import DistributedBatchSampler

ctx = paratrain.init()  # reads RANK/WORLD_SIZE/... from the launcher; world size 1 without one
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16
y = torch.tensor(digits.target)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer, strategy = paratrain.setup(model, optimizer, strategy="ddp", ctx=ctx)
sampler = DistributedBatchSampler(
    len(x), global_batch_size=64, rank=strategy.dp_rank, world_size=strategy.dp_size
)
for _ in range(200):
    idx = sampler.next_batch()  # this rank's share of the next global batch; epochs advance by themselves
    loss = F.cross_entropy(model(x[idx].to(ctx.device)), y[idx].to(ctx.device))
    optimizer.zero_grad()
    loss.backward()  # DDP all-reduces gradients during backward
    optimizer.step()
accuracy = (model(x.to(ctx.device)).argmax(1).cpu() == y).float().mean().item()
paratrain.print0(
    f"world size {ctx.world_size}: final loss {loss.item():.3f}, train accuracy {accuracy:.1%}", ctx=ctx
)
paratrain.shutdown()
