"""Correct: an Accelerate script that reads LOCAL_RANK; accelerator.prepare shards the loader and wraps the model."""

import os

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

local_rank = int(os.environ.get("LOCAL_RANK", -1))
accelerator = Accelerator()
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
loader = DataLoader(data, batch_size=32, shuffle=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt, loader = accelerator.prepare(model, opt, loader)
for epoch in range(3):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    if local_rank in (-1, 0):
        print(f"epoch {epoch} loss {loss.item():.3f}")
