"""ResNet-18/34 for 32x32 inputs (CIFAR style), with BatchNorm.

He et al., "Deep Residual Learning for Image Recognition" (CVPR 2016), https://arxiv.org/abs/1512.03385.
The ImageNet stem (7x7 stride-2 convolution + max-pool) would shrink a 32x32 image to 8x8 before the
first stage, so, as is usual for CIFAR, the stem is a single 3x3 stride-1 convolution. Four stages of
BasicBlocks ([2, 2, 2, 2] for ResNet-18, [3, 4, 6, 3] for ResNet-34) double the width and halve the
resolution, then global average pooling and a linear head. The width of the first stage is
``model.channels`` (64 in the paper; paratrain's default 32 is 4x cheaper).

``model.blocks`` lists the residual blocks in order: the unit that activation checkpointing recomputes
and that sharded strategies wrap.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import ModelConfig
from paratrain.models.registry import register_model

DEPTHS: dict[int, list[int]] = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3]}


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the shortcut (a 1x1 strided projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(
        self, depth: int, in_channels: int, width: int, num_outputs: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"ResNet depth {depth} is not supported: use 18 or 34")
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        c_in = width
        for stage, n in enumerate(DEPTHS[depth]):
            c_out = width * 2**stage
            for i in range(n):
                blocks.append(BasicBlock(c_in, c_out, stride=2 if stage > 0 and i == 0 else 1))
                c_in = c_out
        self.blocks = nn.ModuleList(blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(c_in, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.dropout(self.pool(x).flatten(1)))


def _build(depth: int, cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    if len(input_shape) != 3:
        raise ValueError(
            f"model 'resnet{depth}' needs image inputs (C, H, W), got shape {input_shape}: use --model mlp"
        )
    if min(input_shape[1:]) < 8:
        raise ValueError(
            f"model 'resnet{depth}' downsamples 8x; inputs of {input_shape[1]}x{input_shape[2]} are too small. "
            "Use --model cnn for 8x8 digits."
        )
    return ResNet(depth, input_shape[0], cfg.channels, num_outputs, cfg.dropout)


@register_model("resnet18")
def resnet18(cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    return _build(18, cfg, input_shape, num_outputs)


@register_model("resnet34")
def resnet34(cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    return _build(34, cfg, input_shape, num_outputs)


@register_model("resnet")
def resnet(cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """``resnet`` is ResNet-18."""
    return _build(18, cfg, input_shape, num_outputs)
