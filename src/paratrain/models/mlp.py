"""A multi-layer perceptron over flattened inputs."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from paratrain.config import ModelConfig
from paratrain.models.registry import register_model


class MLPBlock(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, layers: int, num_outputs: int, dropout: float = 0.0) -> None:
        super().__init__()
        dims = [d_in] + [hidden] * layers
        self.blocks = nn.ModuleList(MLPBlock(a, b) for a, b in itertools.pairwise(dims))
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.dropout(x))


@register_model("mlp")
def mlp(cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    return MLP(math.prod(input_shape), cfg.hidden, cfg.layers, num_outputs, cfg.dropout)
