"""A small convolutional network for small images (8x8 digits, 28x28 MNIST, 32x32 CIFAR)."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import ModelConfig
from paratrain.models.registry import register_model


class ConvBlock(nn.Module):
    """conv3x3 -> [BatchNorm] -> ReLU -> conv3x3 -> [BatchNorm] -> ReLU -> 2x2 max-pool."""

    def __init__(self, c_in: int, c_out: int, batchnorm: bool) -> None:
        super().__init__()
        norm = (lambda c: nn.BatchNorm2d(c)) if batchnorm else (lambda c: nn.Identity())
        self.net = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=not batchnorm),
            norm(c_out),
            nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=not batchnorm),
            norm(c_out),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(
        self, in_channels: int, channels: int, num_outputs: int, batchnorm: bool, dropout: float
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [ConvBlock(in_channels, channels, batchnorm), ConvBlock(channels, 2 * channels, batchnorm)]
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(2 * channels, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.dropout(self.pool(x).flatten(1)))


@register_model("cnn")
def cnn(cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    if len(input_shape) != 3:
        raise ValueError(
            f"model 'cnn' needs image inputs (C, H, W), got shape {input_shape}: use --model mlp"
        )
    return CNN(input_shape[0], cfg.channels, num_outputs, cfg.batchnorm, cfg.dropout)
