"""Data and placement checks (the classic pitfalls of data-parallel input pipelines), reported once per job as warnings.

Each finding carries the rule id of ``paratrain lint`` for the same mistake, so a user can look the rule
up and find the static check that would have caught it before the run:

- ``no-distributed-sampler``: every rank's first batch is bitwise identical (first forward of a wrapped
  model; compared by rank 0 at its next optimizer step);
- ``no-set-epoch``: a ``DistributedSampler(shuffle=True)`` yields the same order twice in a row;
- ``ddp-before-device``: a wrapped model's parameters on several devices, or on the CPU under NCCL;
- ``hardcoded-device``: the model on a GPU other than ``cuda:LOCAL_RANK`` (first forward);
- ``batchnorm-not-synced``: BatchNorm layers (not SyncBatchNorm) in a DDP model (construction);
- ``data-parallel``: ``nn.DataParallel`` constructed;
- ``input-not-on-device``: the first input on another device than the model (runtime only: no lint twin).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from paratrain.diagnose.guard.analysis import ranks_text
from paratrain.diagnose.guard.desync import tensor_digest
from paratrain.runtime import attempt

FIXES = {
    "no-distributed-sampler": "give the DataLoader sampler=DistributedSampler(dataset) (and no shuffle=True), so "
    "that each rank gets its own part of the data",
    "no-set-epoch": "call sampler.set_epoch(epoch) at the start of every epoch",
    "ddp-before-device": "move the model first, model.to(device), then wrap it: DDP(model, device_ids=[local_rank])",
    "hardcoded-device": 'device = torch.device(f"cuda:{local_rank}") with local_rank = int(os.environ["LOCAL_RANK"]); '
    "torch.cuda.set_device(device)",
    "batchnorm-not-synced": "model = nn.SyncBatchNorm.convert_sync_batchnorm(model) before DDP(model)",
    "data-parallel": "use DistributedDataParallel with one process per GPU (paratrain launch / torchrun)",
    "input-not-on-device": "move every batch to the model's device: x = x.to(device, non_blocking=True)",
}

_said: set[str] = set()
warned = 0
"""Warnings this process printed (the closing summary adds them up over the ranks)."""


def once(key: str) -> bool:
    """True the first time ``key`` is seen in this job: across ranks through the c10d store when there is
    one, else in this process."""
    if key in _said:
        return False
    _said.add(key)
    if dist.is_initialized():
        try:
            store = dist.distributed_c10d._get_default_store()
            return int(store.add(f"paratrain/guard/{attempt()}/once/{key}", 1)) == 1
        except Exception:
            return True
    return True


def warn(rule: str, rank: int, message: str) -> None:
    """``paratrain guard: warning [rule] rank R: message. Fix: ...``, once per rule per job."""
    if not once(f"warn/{rule}"):
        return
    global warned
    line = f"paratrain guard: warning [{rule}] rank {rank}: {message}. Fix: {FIXES[rule]}\n"
    sys.stderr.write(line)
    sys.stderr.flush()
    warned += 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def first_tensor(obj: Any, depth: int = 0) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if depth > 3:
        return None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else ()
    for item in items:
        t = first_tensor(item, depth + 1)
        if t is not None:
            return t
    return None


def _devices(module: torch.nn.Module) -> set[torch.device]:
    return {p.device for p in module.parameters()}


def at_wrap(module: torch.nn.Module, wrapper: str) -> None:
    """Checks when DDP (``wrapper="DDP"``) or DataParallel wraps ``module``."""
    rank = _rank()
    if wrapper == "DataParallel":
        warn("data-parallel", rank, "nn.DataParallel drives all GPUs from one process and one Python thread")
        return
    bn = [
        n
        for n, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
    ]
    if bn:
        warn(
            "batchnorm-not-synced",
            rank,
            f"{len(bn)} BatchNorm layer(s) (first: {bn[0] or 'the model'}) in a DDP model normalize with each "
            "rank's own batch statistics; the running statistics follow rank 0 only",
        )
    devices = _devices(module)
    if len(devices) > 1:
        warn(
            "ddp-before-device",
            rank,
            f"DDP wraps a model whose parameters are on {sorted(map(str, devices))}",
        )
    elif devices == {torch.device("cpu")} and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        warn("ddp-before-device", rank, "DDP wraps a model whose parameters are still on the CPU under NCCL")


def at_first_forward(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
    """Checks at the first forward of a wrapped model (local; the input comparison is finished later by
    :func:`compare_inputs`)."""
    rank = _rank()
    devices = _devices(module)
    x = first_tensor((args, kwargs))
    cuda = [d for d in devices if d.type == "cuda"]
    if len(devices) > 1:
        warn("ddp-before-device", rank, f"the wrapped model's parameters are on {sorted(map(str, devices))}")
    if cuda and torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        on = {d.index if d.index is not None else torch.cuda.current_device() for d in cuda}
        if torch.cuda.device_count() >= local_world > 1 and on != {local_rank}:
            warn(
                "hardcoded-device",
                rank,
                f"LOCAL_RANK is {local_rank} but the model is on {', '.join(f'cuda:{i}' for i in sorted(on))}: "
                "ranks share a GPU while others stay idle",
            )
    if x is not None and devices and x.device not in devices and x.device.type != "meta":
        warn(
            "input-not-on-device",
            rank,
            f"the first input is on {x.device} but the model's parameters are on {sorted(map(str, devices))}",
        )
    if x is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    # No collective here: a first forward may run on some ranks only (an evaluation on rank 0) and a
    # collective would deadlock it. Each rank leaves its input's digest in the store; rank 0 compares them
    # at its next optimizer step (:func:`compare_inputs`), by when DDP's gradient all-reduce guarantees that
    # every rank has run its first forward.
    shape = f"{str(x.dtype).removeprefix('torch.')}[{','.join(map(str, x.shape))}]"
    digest = ",".join(str(v) for v in tensor_digest(x).tolist())
    _store().set(f"{_prefix()}input/{rank}", f"{shape}|{digest}")


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _prefix() -> str:
    return f"paratrain/guard/{attempt()}/"


def compare_inputs() -> bool:
    """Rank 0: once every rank published its first input, warn if they are all identical. Returns True
    once decided (or nothing to decide), False to be called again later. Never blocks."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return True
    world = dist.get_world_size()
    keys = [f"{_prefix()}input/{r}" for r in range(world)]
    store = _store()
    if not store.check(keys):
        return False
    values = [bytes(v).decode() for v in store.multi_get(keys)]
    if len(set(values)) == 1:
        warn(
            "no-distributed-sampler",
            dist.get_rank(),
            f"the first batch ({values[0].split('|')[0]}) is identical on {ranks_text(list(range(world)))}: every "
            "rank trains on the same data, so more ranks bring no speedup",
        )
    return True


def sampler_order(sampler: Any, indices: list[int]) -> None:
    """Called with each epoch's indices of a ``DistributedSampler``: the same shuffled order twice in a row,
    from a sampler whose ``set_epoch`` was never called (a script that calls it and then iterates twice in
    one epoch, e.g. for the training accuracy, sees one order twice by design)."""
    if not getattr(sampler, "shuffle", False) or len(indices) < 2:
        return
    if getattr(sampler, "_paratrain_guard_set_epoch", False):
        return
    key = hash(tuple(indices))
    if getattr(sampler, "_paratrain_guard_order", None) == key:
        warn(
            "no-set-epoch",
            _rank(),
            f"DistributedSampler(shuffle=True) gave the same order two epochs in a row (its epoch stayed "
            f"{getattr(sampler, 'epoch', '?')}): every epoch sees the data in the same order",
        )
    sampler._paratrain_guard_order = key
