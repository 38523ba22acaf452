"""Mixed precision: bf16 autocast (CPU and GPU), fp16 autocast with a GradScaler (GPU only)."""

from __future__ import annotations

import contextlib

import torch

from paratrain.config import ConfigError


class Precision:
    """``autocast()`` around forward, ``backward()``/``unscale()``/``step()`` around the optimizer."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision == "fp16" and device.type != "cuda":
            raise ConfigError(
                "--precision fp16 needs a CUDA GPU: fp16 autocast with loss scaling is not supported on CPU. "
                "Use --precision bf16 (autocast works on CPU) or fp32."
            )
        self.precision = precision
        self.device = device
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale before clipping (fp16 only)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
