"""Desync detection: are the replicas of every parameter and buffer still bitwise identical?

Each rank reduces each tensor to a 3-number digest of its *bits* (the tensor viewed as integers, widened to
int64): the sum and a sum weighted by pseudo-random odd position weights, in wrapping integer arithmetic,
and the element count. Integer
addition is associative, so the digest does not depend on the reduction order, the thread count or the
device: two replicas agree exactly when they should, and a one-ulp difference anywhere shows. The digests
(``3 x 8`` bytes per tensor) travel in one ``all_gather`` per comparison group; no tensor is moved.

Which ranks compare (the classic DDP pitfalls: "training divergence" from unsynchronized statistics or
initialization):

- plain tensors (DDP, the replicated buffers of any strategy): all ranks of ``group`` (default: world);
- DTensor parameters (FSDP2 ``fully_shard``, HSDP, TP): only ranks that hold the same piece, i.e. the
  process group of each mesh axis on which the placement is ``Replicate()``. Pure FSDP (sharded on every
  axis) has nothing to compare for parameters; a log line says so once.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

_CHUNK = 1 << 20
_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_said_sharded = False
_KEEP: list[Any] = []


def ranks_text(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 0,2``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ",".join(str(r) for r in ranks)


class GuardError(RuntimeError):
    """A fatal runtime finding of ``paratrain launch --guard``; the job stops."""


class DesyncError(GuardError):
    """Replicas that should be identical differ; the message names the step, the tensor and the ranks."""


def _weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = ((torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=device) * 2654435761) % (1 << 31)) | 1
        _WEIGHTS[device] = w
    return w


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """``int64[3]`` on ``t``'s device: equal for two tensors exactly when (barring a 2^-64 collision) their
    dtype, shape and bits are equal."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    x = x.contiguous().reshape(-1)
    out = torch.zeros(3, dtype=torch.int64, device=x.device)
    if x.numel() == 0:
        return out
    v = x.view(_INT_VIEW[x.element_size()])
    w = _weights(x.device)
    for i in range(0, v.numel(), _CHUNK):
        c = v[i : i + _CHUNK].to(torch.int64)
        out[0] += c.sum()
        out[1] += (c * w[: c.numel()]).sum()
    out[2] = x.numel()  # a zero-filled tensor of another size differs too
    return out


def _group_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group))
    if backend == "nccl" or (backend.startswith("cuda:") and "cpu:" not in backend):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _compare_groups(name: str, t: torch.Tensor, group: Any) -> list[tuple[Any, torch.Tensor]]:
    """``(process group, local tensor)`` pairs to compare ``t`` over."""
    global _said_sharded
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        DTensor = ()  # type: ignore[assignment,misc]
    if isinstance(t, DTensor):
        mesh, placements = t.device_mesh, t.placements
        axes = [i for i, p in enumerate(placements) if p.is_replicate() and mesh.size(i) > 1]
        if not axes:
            if not _said_sharded and dist.get_rank() == 0:
                _said_sharded = True
                print(
                    f"paratrain guard: desync check: {name} and the other DTensor parameters are sharded on "
                    "every mesh axis (FSDP without a replicate axis): no two ranks hold the same piece, nothing "
                    "to compare; buffers are still compared",
                    file=sys.stderr,
                    flush=True,
                )
            return []
        local = t.to_local()
        return [(mesh.get_group(i), local) for i in axes]
    return [(group, t)]


def named_state(model: Any) -> list[tuple[str, torch.Tensor]]:
    """``("parameter fc.weight", p)``, ... then the buffers that must agree; DDP's ``module.`` prefix removed.

    Buffers left out, because replicas legitimately differ there between two forwards:
    - all buffers of a DDP model with ``broadcast_buffers=True`` (the default): DDP overwrites them with
      rank 0's at every forward, so a difference cannot last;
    - the running statistics of plain BatchNorm layers: each rank updates them from its own batch (the
      ``batchnorm-not-synced`` warning covers that).
    """
    ddp = type(model).__name__ == "DistributedDataParallel"
    inner = model.module if ddp else model
    out = [(f"parameter {n}", p) for n, p in inner.named_parameters()]
    if ddp and getattr(model, "broadcast_buffers", True):
        return out
    local = {
        id(b)
        for m in inner.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
        for b in m.buffers(recurse=False)
    }
    out += [(f"buffer {n}", b) for n, b in inner.named_buffers() if b is not None and id(b) not in local]
    return out


def compare(
    named: Iterable[tuple[str, torch.Tensor]],
    step: int,
    group: Any = None,
    last_ok_step: int | None = None,
    unrecorded: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """Gather digests of ``named`` tensors over their comparison groups; raise :class:`DesyncError` at the
    first tensor (in the given order) whose replicas differ. ``unrecorded``: a context the check's own
    collectives run in (the guard passes one that keeps them out of its collective record)."""
    buckets: dict[int, tuple[Any, list[tuple[int, str]], list[torch.Tensor]]] = {}
    order: list[int] = []
    for pos, (name, t) in enumerate(named):
        for g, local in _compare_groups(name, t, group):
            key = id(g) if g is not None else 0
            if key not in buckets:
                buckets[key] = (g, [], [])
                order.append(key)
            buckets[key][1].append((pos, name))
            buckets[key][2].append(local)
    findings: list[tuple[int, str]] = []  # (position in ``named``, message)
    for key in order:
        g, names, tensors = buckets[key]
        world = dist.get_world_size(g)
        if world < 2:
            continue
        device = _group_device(g)
        mine = torch.stack([tensor_digest(t).to(device) for t in tensors])
        gathered = [torch.empty_like(mine) for _ in range(world)]
        with unrecorded():
            work = dist.all_gather(gathered, mine, group=g, async_op=True)
            work.wait()
        # Keep the work (and its tensors) referenced from Python. Otherwise Gloo's worker thread may drop the
        # last reference and need the GIL to free the tensors, while the main thread, holding the GIL, tears
        # down the process group and joins that very thread (a deadlock seen when a script ends right after
        # a check: ProcessGroupGloo::~ProcessGroupGloo joins a thread stuck in ~AsyncAllgatherWork).
        _KEEP.append((work, gathered, mine))
        del _KEEP[:-8]
        table = torch.stack(gathered).cpu()  # [world, n, 3]
        ranks = dist.get_process_group_ranks(g) if g is not None else list(range(world))
        for i, (pos, name) in enumerate(names):
            col = [tuple(table[r, i].tolist()) for r in range(world)]
            if len(set(col)) > 1:
                findings.append((pos, _describe(name, col, ranks, step, last_ok_step)))
                break
    if findings:
        raise DesyncError(min(findings)[1])


def _describe(name: str, col: list[tuple[int, ...]], ranks: list[int], step: int, last_ok: int | None) -> str:
    votes: dict[tuple[int, ...], list[int]] = {}
    for r, d in zip(ranks, col, strict=True):
        votes.setdefault(d, []).append(r)
    groups = sorted(votes.values(), key=lambda rs: (-len(rs), rs[0]))
    since = f" (in sync at step {last_ok})" if last_ok is not None else ""
    head = f"desync at step {step}{since}: {name}"
    if len(groups) > 1 and len(groups[0]) > len(groups[1]):
        odd = sorted(r for rs in groups[1:] for r in rs)
        verb = "agrees" if len(groups[0]) == 1 else "agree"
        return f"{head} differs on {ranks_text(odd)} ({ranks_text(groups[0])} {verb})"
    return f"{head} differs: {' vs '.join(ranks_text(rs) for rs in groups)} (no majority)"


def check_desync(model: Any, step: int, group: Any = None, last_ok_step: int | None = None) -> None:
    """Compare every parameter and buffer of ``model`` (DDP, FSDP2 or a plain module) across replicas.

    Collective: every rank of ``group`` (default: world) must call it at the same step. Raises
    :class:`DesyncError` naming the step, the first differing tensor and the ranks that differ from the
    majority. For ``paratrain train --check-desync-every K``: call it after every K-th optimizer step.
    """
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return
    compare(named_state(model), step, group, last_ok_step)
