"""Correct: Lightning Fabric: setup() wraps (and broadcasts) the model, setup_dataloaders() shards the loader."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

fabric = L.Fabric(accelerator="cuda", devices=4, strategy="ddp")
fabric.launch()
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = fabric.setup(model, opt)
data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
loader = fabric.setup_dataloaders(DataLoader(data, batch_size=32, shuffle=True))
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x), y)
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
