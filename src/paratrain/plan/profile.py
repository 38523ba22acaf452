"""What one sample of a model that is not a transformer costs, as a meta-device trace measures it
(:mod:`.trace` fills it; :mod:`.model` and the activation model read it). No torch."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ActivationProfile"]


@dataclass(frozen=True)
class ActivationProfile:
    """What one sample costs a model that is not a transformer, measured by a meta-device trace (fp32)."""

    saved: float
    """Bytes saved for backward per sample, the input and logits included."""
    blocks_saved: tuple[float, ...]
    """Of which, per sample, inside each block of ``model.blocks``."""
    blocks_input: tuple[float, ...]
    """Per sample, each block's input (what activation checkpointing keeps instead)."""
    flops: float
    """Forward + backward FLOPs per sample (``torch.utils.flop_counter``)."""
    batch: float = 0.0
    """Bytes per sample of the batch on the device: the fp32 input and, for a classifier, its int64 target."""
