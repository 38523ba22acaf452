"""What a run reports at its end: the ``--json`` summary, the parameter digest, memory figures and MFU."""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.parallel import canonical_name, model_state_bytes
from paratrain.runtime import Context
from paratrain.spec.hardware import gpu_peak_flops


@dataclass
class TrainResult:
    """What a run produced; ``summary()`` is the ``--json`` contract of DESIGN.md."""

    strategy: str
    world_size: int
    num_params: int
    steps: int
    losses: list[float]
    final_loss: float | None
    eval_accuracy: float | None
    eval_loss: float | None
    samples_per_s: float | None
    param_sha256: str | None
    param_norm: float | None
    model_state_bytes_per_rank: int | None
    restarts: int
    resumed_from_step: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


def _full_state_dict(model: nn.Module, cpu_offload: bool = False) -> dict[str, Any]:
    """``get_model_state_dict(full_state_dict=True)``: every DTensor gathered to a full tensor (collective).

    An ``fsdp+tp`` parameter is ``(_StridedShard(0), Shard(0))`` on a mesh whose ``dp_shard`` and ``tp`` axes are
    not flattened, so DTensor gathers it with two all-gathers and logs a warning saying so on every rank. This
    runs once per run, for the summary (not a hot path), so that one logger is quietened around it only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
        return dict(get_model_state_dict(model, options=options))
    finally:
        redistribute_log.setLevel(level)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full, unsharded parameters in registration order, on rank 0 (``None`` on other ranks).

    Collective. A pipeline rank holds only its stages (the model carries the full model's parameter order,
    ``_paratrain_param_order``): every rank gathers its stages' full tensors (over its tensor and data
    axes), and rank 0 collects one copy of each stage with ``gather_object`` and puts them in the full order.
    """
    full_order: list[str] | None = getattr(model, "_paratrain_param_order", None)
    if full_order is not None and dist.is_initialized() and dist.get_world_size() > 1:
        sd = _full_state_dict(model)
        # one copy per stage is enough: only the ranks at tensor/data coordinate 0 send theirs
        send = getattr(model, "_paratrain_pp_sender", True)
        local = {k: v.detach().cpu() for k, v in sd.items() if isinstance(v, torch.Tensor)} if send else {}
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(local, gathered if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return {name: merged[name] for name in full_order}
    sd = _full_state_dict(model, cpu_offload=True)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    order = [canonical_name(n) for n, _ in model.named_parameters()]
    out: dict[str, torch.Tensor] = {}
    for name in order:
        t: Any = sd[name]
        out[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return out


def param_digest(params: dict[str, torch.Tensor]) -> tuple[str, float]:
    """sha256 of the float32 bytes of every parameter in name order, and the float64 L2 norm."""
    h = hashlib.sha256()
    sq = 0.0
    for t in params.values():
        f = t.detach().to(torch.float32).contiguous().cpu()
        h.update(f.numpy().tobytes())
        sq += float(f.double().pow(2).sum())
    return h.hexdigest(), math.sqrt(sq)


@dataclass
class MemoryFigures:
    """The largest rank's memory figures of a run (bytes; ``None`` where not measured)."""

    model_state: int
    """Parameters + gradients + optimizer state held at rest (``model_state_bytes``)."""
    peak: int | None
    """Live bytes of the memory-tracked step (``None`` when no step was tracked)."""
    cuda_allocated: int | None
    """``torch.cuda.max_memory_allocated`` over the training steps; ``None`` on the CPU."""
    cuda_reserved: int | None
    """``torch.cuda.max_memory_reserved``: allocated plus the caching allocator's blocks."""


def gather_memory(
    model: nn.Module, optimizer: Any, ctx: Context, peak: int | None, cuda_peaks: list[int] | None
) -> MemoryFigures:
    """Collective: the largest, over ranks, of this rank's model-state bytes, step peak and CUDA peaks."""
    mem = torch.tensor(  # on the backend's device: NCCL has no CPU tensors
        [model_state_bytes(model, optimizer), peak or 0, *(cuda_peaks or [0, 0])],
        dtype=torch.int64,
        device=ctx.device,
    )
    if ctx.distributed:
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # the largest rank's figures
    on_cuda = cuda_peaks is not None
    return MemoryFigures(
        model_state=int(mem[0]),
        peak=(int(mem[1]) or None) if peak is not None else None,
        cuda_allocated=int(mem[2]) if on_cuda else None,
        cuda_reserved=int(mem[3]) if on_cuda else None,
    )


def device_peak_flops(device: torch.device, precision: str = "bf16") -> float | None:
    """Peak dense FLOP/s of ``device`` at ``precision`` (16-bit for bf16/fp16), or ``None`` when unknown
    (CPUs, and GPUs not in the table). Used for MFU; never guessed."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return gpu_peak_flops(torch.cuda.get_device_name(device), precision)


def model_flops_utilization(
    model: nn.Module, ctx: Context, seq_len: int, tokens_per_s: float | None, precision: str
) -> float | None:
    """Achieved FLOP/s over the devices' peak (PaLM's MFU): ``tokens/s x FLOPs per token / (world x peak)``,
    with FLOPs per token from the model's spec (``6·N + 12·L·H·Q·T``, :func:`paratrain.models.llama.
    flops_per_token`; a Hugging Face model's from its config). ``None`` when the peak of the device is not
    known (every CPU) or the model's spec has no FLOPs count."""
    from paratrain.models.spec import spec_of

    inner = getattr(model, "module", model)  # DDP's wrapped module
    spec = spec_of(inner)
    peak = device_peak_flops(ctx.device, precision)
    if spec is None or spec.flops_per_token is None or peak is None or not tokens_per_s:
        return None
    return tokens_per_s * spec.flops_per_token(inner, seq_len) / (ctx.world_size * peak)
