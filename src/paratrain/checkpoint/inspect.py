"""``paratrain ckpt inspect``, ``paratrain ckpt export`` and the resume check done before any worker starts.

Everything here runs in one process without a process group: it reads ``commit.json``, ``train_state.json``
and ``.metadata`` (with the restricted unpickler of :mod:`paratrain.checkpoint.safe`).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint import safe
from paratrain.checkpoint.manager import (
    check_checkpoint,
    compare_state,
    find_latest_valid,
    list_checkpoints,
    mismatch_message,
    step_of,
)
from paratrain.config import ConfigError, RunConfig


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def describe(path: str | Path) -> dict[str, Any]:
    """One checkpoint directory: step, size, world size, strategy, model, validity and its problems."""
    p = Path(path)
    problems = check_checkpoint(p)
    state: dict[str, Any] = {}
    try:
        state = json.loads((p / "train_state.json").read_text())
    except (OSError, ValueError):
        pass
    cfg = state.get("config", {})
    return {
        "path": str(p),
        "step": step_of(p) if step_of(p) is not None else state.get("step"),
        "bytes": _dir_bytes(p) if p.is_dir() else 0,
        "world_size": state.get("world_size"),
        "strategy": state.get("strategy"),
        "model": cfg.get("model", {}).get("name"),
        "valid": not problems,
        "problems": problems,
    }


def inspect_dir(root: str | Path) -> dict[str, Any]:
    """A checkpoint directory (or one step directory): every step, what ``latest`` names, what auto-resume
    would load, and saves that never finished (temporary directories)."""
    r = Path(root)
    if not r.exists():
        raise ConfigError(f"{r} does not exist. Give a checkpoint directory (e.g. runs/NAME/checkpoints).")
    if step_of(r) is not None:
        return {
            "root": str(r.parent),
            "checkpoints": [describe(r)],
            "latest": None,
            "resume_auto": None,
            "in_progress": [],
        }
    latest = (r / "latest").read_text().strip() if (r / "latest").is_file() else None
    auto = find_latest_valid(r)
    return {
        "root": str(r),
        "checkpoints": [describe(p) for p in list_checkpoints(r)],
        "latest": latest,
        "resume_auto": str(auto) if auto else None,
        "in_progress": sorted(p.name for p in r.glob(".step_*.tmp")),
    }


def format_inspect(info: dict[str, Any]) -> str:
    lines = [f"{info['root']}: latest -> {info['latest']}, --resume auto loads {info['resume_auto']}"]
    lines.append(f"{'step':>10} {'size':>10} {'world':>5} {'strategy':>9} {'model':>8}  status")
    for c in info["checkpoints"]:
        status = "valid" if c["valid"] else "INVALID: " + "; ".join(c["problems"])
        lines.append(
            f"{c['step']!s:>10} {c['bytes'] / 2**20:>8.2f}Mi {c['world_size']!s:>5} "
            f"{c['strategy']!s:>9} {c['model']!s:>8}  {status}"
        )
    for name in info["in_progress"]:
        lines.append(f"{name}: unfinished save (being written, or left by a crash; never loaded)")
    return "\n".join(lines)


def export_safetensors(step_dir: str | Path, out: str | Path) -> dict[str, Any]:
    """Consolidate the model of a (sharded) checkpoint into one ``.safetensors`` file of full tensors."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    p = Path(step_dir)
    problems = check_checkpoint(p)
    if problems:
        raise ConfigError(f"{p} is not a usable checkpoint: {'; '.join(problems)}")
    md = safe.read_metadata(p)
    model: dict[str, torch.Tensor] = {}
    for key, meta in md.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    # DCP assembles every shard written by every rank into these full tensors (no process group needed).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(
            {"model": model},
            storage_reader=safe.SafeFileSystemReader(str(p)),
            planner=safe.SafeLoadPlanner(),
            no_dist=True,
        )
    state = json.loads((p / "train_state.json").read_text())
    meta_out = {
        "step": str(state.get("step")),
        "strategy": str(state.get("strategy")),
        "model": json.dumps(state.get("config", {}).get("model", {})),
        "format": "pt",
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.items()}, str(out), metadata=meta_out)
    return {
        "out": str(out),
        "tensors": len(model),
        "bytes": sum(t.numel() * t.element_size() for t in model.values()),
    }


def preflight_resume(cfg: RunConfig, meta_model: nn.Module, run_dir: str | Path | None = None) -> Path | None:
    """The checkpoint the workers will resume from, checked against the model before any process starts.

    Raises :class:`ConfigError` listing every mismatch (missing/unexpected keys, shapes), or the problems of
    an explicitly given broken checkpoint. With ``--resume auto`` broken checkpoints are skipped (reported).
    """
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        root = cfg.checkpoint.dir or (str(Path(run_dir) / "checkpoints") if run_dir else None)
        if root is None:
            return None

        def skipped(p: Path, problems: list[str]) -> None:
            print(f"paratrain: warning: skipping checkpoint {p}: {'; '.join(problems)}", file=sys.stderr)

        path = find_latest_valid(root, on_skip=skipped)
        if path is None:
            return None
    else:
        path = Path(mode)
        problems = check_checkpoint(path)
        if problems:
            raise ConfigError(
                f"--resume {mode}: not a usable checkpoint: {'; '.join(problems)}. Give a committed step_NNNNNNNN "
                "directory, --resume auto (newest valid one) or --resume never."
            )
    try:
        md = safe.read_metadata(path)
    except Exception as e:
        raise ConfigError(f"{path}: cannot read the checkpoint metadata safely: {e}") from None
    shapes = {k: v.shape for k, v in meta_model.state_dict().items()}
    mismatches = compare_state(md, shapes)
    if mismatches:
        raise ConfigError(mismatch_message(path, mismatches))
    return path
