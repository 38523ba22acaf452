"""Checkpoint manager: ``DIR/step_NNNNNNNN/`` directories written by DCP and committed atomically.

Save protocol (every rank takes part):

1. rank 0 creates ``DIR/.step_NNNNNNNN.tmp/``; barrier;
2. ``torch.distributed.checkpoint.save`` writes the model and optimizer state dicts: each rank writes its
   own shards in parallel (replicated tensors are written once), and the coordinator writes ``.metadata``
   last;
3. each rank writes its RNG states (``rng/rank_NNNNN.pt``, tensors only); rank 0 writes
   ``train_state.json`` (step, sampler position, config, world size, strategy); barrier;
4. rank 0 renames the temporary directory to its final name (the commit), then replaces ``DIR/latest``
   atomically (write ``latest.tmp``, ``os.replace``).

A directory that is not a final ``step_*`` name with ``.metadata`` and ``train_state.json`` is never loaded.
Loading uses ``weights_only=True``: nothing unpickles arbitrary objects.

Reference: https://pytorch.org/docs/stable/distributed.checkpoint.html
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from paratrain.runtime import Context

_STEP_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and why."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_valid_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return bool(_STEP_RE.match(p.name)) and (p / ".metadata").is_file() and (p / "train_state.json").is_file()


def list_checkpoints(root: str | Path) -> list[Path]:
    """Committed-looking step directories under ``root``, oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = [p for p in r.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))  # type: ignore[union-attr]


def find_latest_valid(root: str | Path) -> Path | None:
    """The newest valid checkpoint: the one ``latest`` names when valid, else the newest valid step dir."""
    r = Path(root)
    latest = r / "latest"
    if latest.is_file():
        named = r / latest.read_text().strip()
        if is_valid_checkpoint(named):
            return named
    for p in reversed(list_checkpoints(r)):
        if is_valid_checkpoint(p):
            return p
    return None


def _rng_state() -> dict[str, torch.Tensor]:
    state = {
        "torch_cpu": torch.get_rng_state(),
        "numpy": torch.tensor(np.random.get_state()[1].astype(np.int64)),
        "numpy_pos": torch.tensor([int(np.random.get_state()[2])]),
        "python": torch.tensor(list(random.getstate()[1]), dtype=torch.int64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    keys = state["numpy"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(state["numpy_pos"][0]), 0, 0.0))
    py = tuple(int(v) for v in state["python"].tolist())
    random.setstate((3, py, None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    """Saves and loads ``DIR/step_NNNNNNNN`` checkpoints for one run; every rank constructs one."""

    def __init__(self, root: str | Path, ctx: Context, keep_last: int | None = None) -> None:
        self.root = Path(root)
        self.ctx = ctx
        self.keep_last = keep_last

    # ---- save ---------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: dict[str, Any],
    ) -> Path:
        final = self.root / step_dir_name(step)
        tmp = self.root / f".{step_dir_name(step)}.tmp"
        if self.ctx.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left over by a crashed save: never committed, never loaded
            tmp.mkdir()
            (tmp / "rng").mkdir()
        self.ctx.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / "rng" / f"rank_{self.ctx.rank:05d}.pt")
        if self.ctx.is_main:
            state = dict(train_state, step=step, world_size=self.ctx.world_size)
            _write_json_atomic(tmp / "train_state.json", state)
        self.ctx.barrier()
        if self.ctx.is_main:
            old = None
            if final.exists():
                old = self.root / f".{final.name}.old"
                if old.exists():
                    shutil.rmtree(old)
                os.rename(final, old)
            os.rename(tmp, final)  # the commit
            _fsync_dir(self.root)
            _write_text_atomic(self.root / "latest", final.name + "\n")
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._retain(final)
        self.ctx.barrier()
        return final

    def _retain(self, newest: Path) -> None:
        if self.keep_last is None:
            return
        valid = [p for p in list_checkpoints(self.root) if is_valid_checkpoint(p)]
        for p in valid[: max(0, len(valid) - self.keep_last)]:
            if p != newest:
                shutil.rmtree(p, ignore_errors=True)

    # ---- load ---------------------------------------------------------------------------------------------
    def load(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load model, optimizer and this rank's RNG state; return the saved training state."""
        p = Path(path)
        if not is_valid_checkpoint(p):
            raise CheckpointError(
                f"{p} is not a committed checkpoint (needs a step_NNNNNNNN name, .metadata and "
                "train_state.json). Point --resume at a step directory, or use --resume auto."
            )
        state = json.loads((p / "train_state.json").read_text())
        model_sd, optim_sd = get_state_dict(model, optimizer)
        to_load = {"model": model_sd, "optim": optim_sd}
        dcp.load(to_load, checkpoint_id=str(p))
        set_state_dict(model, optimizer, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"])
        rng_file = p / "rng" / f"rank_{self.ctx.rank:05d}.pt"
        if rng_file.is_file() and int(state.get("world_size", -1)) == self.ctx.world_size:
            _set_rng_state(torch.load(rng_file, weights_only=True))
        return state


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json_atomic(path: Path, obj: Any) -> None:
    _write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def broadcast_object(obj: Any, ctx: Context) -> Any:
    """Rank 0's ``obj`` on every rank (JSON-able objects only)."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
