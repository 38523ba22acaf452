"""Bytes per rank: model states (ZeRO), activations (Korthikanti et al.), temporary buffers, and the peak.

**Model states** (Rajbhandari et al., "ZeRO", SC'20, https://arxiv.org/abs/1910.02054, section 5). Ψ
parameters on this rank (after tp and pp), N = the ``dp_shard`` degree. Mixed-precision Adam keeps 2Ψ fp16
parameters, 2Ψ fp16 gradients and KΨ optimizer state, K = 12 (fp32 master copy, momentum and variance):

==========  ======================  ==============================================================
stage       bytes per rank          paratrain strategy
==========  ======================  ==============================================================
baseline    (2 + 2 + K)Ψ            ddp, dp, tp, pp (sharding ``none``)
1           (2 + 2 + K/N)Ψ          zero1 (``optimizer``)
2           (2 + (2 + K)/N)Ψ        zero2 (``grads``)
3           (2 + 2 + K)Ψ/N          zero3, hsdp, fsdp+tp, fsdp+pp, fsdp+tp+pp (``full``)
==========  ======================  ==============================================================

``--precision fp16-mixed`` is exactly that. ``fp32`` (paratrain on CPU today) and ``bf16`` / ``fp16``
(``paratrain train``'s autocast: parameters, gradients and state stay fp32; with FSDP, ``MixedPrecisionPolicy``
computes in 16 bits over fp32 sharded masters) keep 4Ψ parameters + 4Ψ gradients + 8Ψ Adam moments, so ddp = 16Ψ, zero1 = 8Ψ + 8Ψ/N,
zero2 = 4Ψ + 12Ψ/N, zero3 = 16Ψ/N. SGD keeps 4Ψ of momentum (8Ψ with an fp32 master under fp16-mixed),
nothing without momentum (4Ψ master).

**Activations**: :mod:`paratrain.plan.activations`.

**Temporary buffers and the peak**: :mod:`paratrain.plan.peak` (what is live at each moment of a step that can
be the highest: backward's start, FSDP's per-unit post-backward, ZeRO's reduce-scatter, the optimizer step).
With ``--offload`` (FSDP only) the states live in host memory and the device peak excludes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16", "fp16-mixed")
OPTIMIZERS = ("adamw", "adam", "sgd")
SHARDINGS = ("none", "optimizer", "grads", "full")


def zero_states(psi: float, n: int, stage: int, k: float = 12) -> float:
    """The ZeRO paper's bytes per rank of model states: stage 0 (baseline), 1, 2 or 3, K bytes of optimizer."""
    return [
        (2 + 2 + k) * psi,
        (2 + 2 + k / n) * psi,
        (2 + (2 + k) / n) * psi,
        (2 + 2 + k) * psi / n,
    ][stage]


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of every kind of tensor, for one precision and optimizer."""

    param: int
    """Stored parameters."""
    grad: int
    """Stored gradients."""
    optimizer: int
    """Optimizer state per parameter (the ZeRO paper's K, with the master copy under fp16-mixed)."""
    compute: int
    """Parameters as forward uses them (FSDP all-gathers these; autocast casts to them)."""
    activation: int
    """Activations (the 16-bit terms of Korthikanti's formulas are 2 bytes; 4 in fp32)."""


def dtypes(precision: str, optimizer: str = "adamw", momentum: float = 0.9) -> Dtypes:
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}.")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}.")
    mixed = precision == "fp16-mixed"
    moments = 8 if optimizer in ("adam", "adamw") else (4 if momentum else 0)
    return Dtypes(
        param=2 if mixed else 4,
        grad=2 if mixed else 4,
        optimizer=moments + (4 if mixed else 0),
        compute=4 if precision == "fp32" else 2,
        activation=4 if precision == "fp32" else 2,
    )


@dataclass(frozen=True)
class States:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_states(psi: float, n: int, sharding: str, d: Dtypes) -> States:
    """Bytes of ``psi`` parameters' states on one rank, ``sharding`` over ``n`` ranks (see the table above)."""
    if sharding not in SHARDINGS:
        raise ConfigError(f"sharding {sharding!r}: one of {', '.join(SHARDINGS)}.")
    p, g, o = psi * d.param, psi * d.grad, psi * d.optimizer
    if sharding == "none":
        return States(p, g, o)
    if sharding == "optimizer":
        return States(p, g, o / n)
    if sharding == "grads":
        return States(p, g / n, o / n)
    return States(p / n, g / n, o / n)
