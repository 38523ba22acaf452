"""Save and resume a user's own training loop exactly, as Accelerate's ``save_state``/``load_state`` do.

    ckpt = "runs/mine/checkpoints"
    state = paratrain.load_state(ckpt, model, optimizer, sampler=sampler, scheduler=scheduler)
    step = state["step"] if state else 0
    for step in range(step + 1, steps + 1):
        ...
        if step % 100 == 0:
            paratrain.save_state(ckpt, model, optimizer, step, sampler=sampler, scheduler=scheduler)

What is saved, in ``DIR/step_NNNNNNNN/`` with the same atomic commit, checksums and ``DIR/latest`` as
``paratrain train`` (so ``paratrain ckpt inspect``/``export`` read it): the model and optimizer through
DCP (every strategy of :func:`paratrain.setup`, sharded or not; each rank writes its own shards), the
sampler's position and the scheduler's state (``state_dict()``), the user's JSON ``extra``, and every
rank's random number generators (Python, NumPy, torch, CUDA, and named ``generators``). Loading restores
all of them, so the resumed loop draws the same batches and the same random numbers as an uninterrupted one.
Both are collective: call them on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint.layout import find_latest_valid, step_of
from paratrain.checkpoint.manager import CheckpointManager
from paratrain.checkpoint.state import rng_state, set_rng_state
from paratrain.errors import ConfigError
from paratrain.runtime import Context

__all__ = ["load_state", "save_state"]


def _context(ctx: Context | None) -> Context:
    """``ctx``, or this process's place in the job read from the process group (world 1 without one)."""
    if ctx is not None:
        return ctx
    if dist.is_initialized():
        backend = str(dist.get_backend())
        device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        return Context(dist.get_rank(), dist.get_rank(), dist.get_world_size(), dist.get_world_size(), device,
                       backend, 300.0)  # fmt: skip
    return Context(0, 0, 1, 1, torch.device("cpu"), None, 300.0)


def save_state(
    directory: str | Path,
    model: nn.Module,
    optimizer: Any,
    step: int,
    *,
    sampler: Any = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    generators: dict[str, torch.Generator] | None = None,
    keep_last: int | None = None,
    ctx: Context | None = None,
) -> Path:
    """Save everything a loop needs to resume at ``step`` to ``directory/step_NNNNNNNN`` (collective); returns
    that path. ``keep_last``: keep only the newest K checkpoints of ``directory``."""
    c = _context(ctx)
    manager = CheckpointManager(directory, c, keep_last)
    state: dict[str, Any] = {"step": step, "extra": extra or {}, "world_size": c.world_size}
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    try:
        return manager.save(step, model, optimizer, state, rng_state(generators))
    finally:
        manager.close()


def load_state(
    path: str | Path,
    model: nn.Module,
    optimizer: Any,
    *,
    sampler: Any = None,
    scheduler: Any = None,
    generators: dict[str, torch.Generator] | None = None,
    ctx: Context | None = None,
) -> dict[str, Any] | None:
    """Load the newest valid checkpoint of ``path`` into the given objects (collective). ``path`` is a
    checkpoint directory, a run directory (its ``checkpoints/``), its ``latest`` file or one step directory.
    Returns ``{"step": ..., "extra": ...}``, or ``None`` when a directory holds no checkpoint yet (a fresh
    start); a named step that does not load raises."""
    c = _context(ctx)
    p = Path(path)
    if p.name == "latest" and p.is_file():
        p = p.parent
    if step_of(p) is None:
        root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        found = find_latest_valid(root) if root.is_dir() else None
        if found is None:
            return None
        p = Path(found)
    elif not p.is_dir():
        raise ConfigError(f"load_state: {p} does not exist.")
    manager = CheckpointManager(p.parent, c)
    try:
        loaded = manager.load(p, model, optimizer)
    finally:
        manager.close()
    saved = loaded.train_state
    if sampler is not None and "sampler" in saved:
        sampler.load_state_dict(saved["sampler"])
    if scheduler is not None and "scheduler" in saved:
        scheduler.load_state_dict(saved["scheduler"])
    if loaded.rank_state is not None:
        set_rng_state(loaded.rank_state, generators)
    return {"step": int(saved["step"]), "extra": saved.get("extra", {}), "path": str(loaded.path)}
