"""``paratrain ckpt inspect``, ``paratrain ckpt export`` and the resume check done before any worker starts.

Everything here runs in one process without a process group: it reads ``commit.json``, ``train_state.json``
and ``.metadata`` (with the restricted unpickler of :mod:`paratrain.checkpoint.safe`), and by default every
file's bytes, to compare their checksums (``fast=True``: sizes only).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paratrain.checkpoint import safe
from paratrain.checkpoint.integrity import COMMIT_FILE
from paratrain.checkpoint.layout import (
    LATEST_FILE,
    candidates,
    check_checkpoint,
    compare_state,
    find_latest_valid,
    list_checkpoints,
    mismatch_message,
    read_latest,
    read_manifest,
    step_of,
)
from paratrain.checkpoint.state import TRAIN_STATE_FILE, check_train_state
from paratrain.errors import ConfigError
from paratrain.tables import Col, table

if TYPE_CHECKING:
    from paratrain.config import RunConfig

_STEP_NAME = re.compile(r"step_[0-9]{8,}")


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _read_state(p: Path) -> dict[str, Any]:
    """The training state for display: what parses with the right types, else nothing (never raises)."""
    try:
        state = json.loads((p / TRAIN_STATE_FILE).read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    if check_train_state(state):
        return {}
    return state  # type: ignore[no-any-return]


def describe(path: str | Path, fast: bool = False) -> dict[str, Any]:
    """One checkpoint directory: step, size, world size, strategy, model, validity and its problems
    (checksums compared unless ``fast``)."""
    p = Path(path)
    problems = check_checkpoint(p, verify=not fast)
    manifest = read_manifest(p)
    checksummed = manifest is not None and manifest.digests is not None
    state = _read_state(p)
    cfg = state.get("config", {})
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    return {
        "path": str(p),
        "step": step_of(p) if step_of(p) is not None else state.get("step"),
        "bytes": _dir_bytes(p) if p.is_dir() else 0,
        "world_size": state.get("world_size"),
        "strategy": state.get("strategy"),
        "model": model.get("name"),
        "valid": not problems,
        "verified": not fast and checksummed,
        "checksummed": checksummed,
        "problems": problems,
    }


def inspect_dir(root: str | Path, fast: bool = False) -> dict[str, Any]:
    """A checkpoint directory (or a run directory, its ``latest`` file, one step directory): every step, what
    ``latest`` names, what auto-resume would load, and saves that never finished (temporary directories). ``fast``: sizes, not checksums."""
    r = Path(root)
    if not r.exists():
        raise ConfigError(
            f"{r} does not exist. Give a run directory, its checkpoints/ directory, its latest file or one "
            "step_NNNNNNNN directory."
        )
    if r.name == LATEST_FILE and r.is_file():  # a checkpoint directory's `latest`: that directory
        r = r.parent
    if not r.is_dir():
        raise ConfigError(
            f"{r} is a file, not a checkpoint directory. Give a run directory, a checkpoint directory (with "
            "step_NNNNNNNN/ inside), its latest file or one step directory."
        )
    if step_of(r) is None and (r / "checkpoints").is_dir() and not (r / LATEST_FILE).exists():
        r = r / "checkpoints"  # a run directory
    if step_of(r) is not None:  # one step: what its directory's latest names, not what auto-resume picks
        named, why = read_latest(r.parent)
        return {
            "root": str(r.parent),
            "step_dir": str(r),
            "checkpoints": [describe(r, fast)],
            "latest": named.name if named is not None else None,
            "latest_problem": f"{LATEST_FILE} {why}" if why else None,
            "resume_auto": None,
            "in_progress": [],
        }
    in_progress = sorted(p.name for p in r.glob(".step_*.tmp*"))
    if (
        not (r / LATEST_FILE).exists()
        and not in_progress
        and not any(_STEP_NAME.fullmatch(p.name) for p in r.iterdir())
    ):
        hint = f" (did you mean {r / 'checkpoints'}?)" if (r / "checkpoints").is_dir() else ""
        raise ConfigError(
            f"{r} holds no checkpoints (no step_NNNNNNNN directory, no latest){hint}. Give a checkpoint "
            "directory (e.g. runs/NAME/checkpoints) or one step directory."
        )
    named, why = read_latest(r)
    described = {p: describe(p, fast) for p in list_checkpoints(r)}
    # what --resume auto would pick, from the checks just made (each checkpoint is read once), and what it
    # passes over besides invalid checkpoints (a latest it cannot follow, checkpoints committed after it)
    notes: list[str] = []

    def passed_over(p: Path, why_not: list[str]) -> None:
        notes.append(f"{p.name} {'; '.join(why_not)}")

    auto = next((p for p in candidates(r, passed_over) if p in described and described[p]["valid"]), None)
    return {
        "root": str(r),
        "checkpoints": list(described.values()),
        "latest": named.name if named is not None else None,
        "latest_problem": f"{LATEST_FILE} {why}" if why else None,
        "notes": notes,
        "resume_auto": str(auto) if auto else None,
        "in_progress": in_progress,
    }


def format_inspect(info: dict[str, Any]) -> str:
    if info.get("step_dir"):
        latest = f"its directory's latest -> {info['latest']}" if info["latest"] else "no latest beside it"
        lines = [f"{info['step_dir']}: one step ({latest}; `paratrain ckpt inspect {info['root']}` lists every "
                 "step and what --resume auto loads)"]  # fmt: skip
    else:
        lines = [f"{info['root']}: latest -> {info['latest']}, --resume auto loads {info['resume_auto']}"]
    for note in info.get("notes") or ([info["latest_problem"]] if info.get("latest_problem") else []):
        lines.append(f"warning: {note}")
    cols = [Col("step", ">", 10), Col("size", ">", 10), Col("world", ">", 5), Col("strategy", ">", 9),
            Col("model", ">", 8), Col("status", gap=2)]  # fmt: skip
    rows = []
    for c in info["checkpoints"]:
        if c.get("verified", True):
            ok = "valid"
        elif not c.get("checksummed", True):
            ok = "valid (sizes only: written before checksums, unverified)"
        else:
            ok = "valid (sizes only: --fast)"
        status = ok if c["valid"] else "INVALID: " + "; ".join(c["problems"])
        rows.append([str(c["step"]), f"{c['bytes'] / 2**20:.2f}Mi", str(c["world_size"]), str(c["strategy"]),
                     str(c["model"]), status])  # fmt: skip
    lines += table(cols, rows)
    for name in info["in_progress"]:
        lines.append(f"{name}: unfinished save (being written, or left by a crash; never loaded)")
    return "\n".join(lines)


def resolve_checkpoint(path: str | Path, flag: str = "--ckpt") -> Path:
    """The verified step directory ``path`` stands for, before anything is built from it.

    ``path`` is a ``step_NNNNNNNN`` directory (verified, checksums included: :class:`ConfigError` listing its
    problems), a checkpoint directory or its ``latest`` file (the newest valid step, as ``--resume auto``
    picks it) or a run directory (its ``checkpoints/``). When the step used is not the newest, one ``warning:`` line per
    checkpoint passed over says which and why, on stderr: a reader never uses an older step silently.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(
            f"{flag} {p} does not exist. Give a run directory, a checkpoint directory or a step."
        )
    if p.name == LATEST_FILE and p.is_file():
        p = p.parent
    if step_of(p) is not None:
        problems = check_checkpoint(p)
        if problems:
            raise ConfigError(
                f"{flag} {p} is not a usable checkpoint: {'; '.join(problems)}. Give a committed step_NNNNNNNN "
                "directory (one `paratrain ckpt inspect` calls valid) or its run directory."
            )
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    passed: list[tuple[Path, list[str]]] = []
    found = find_latest_valid(root, on_skip=lambda q, problems: passed.append((q, problems)))
    if found is None:
        why = "".join(f"; {q.name}: {', '.join(problems)}" for q, problems in passed)
        raise ConfigError(f"{flag} {p}: no committed, valid checkpoint in {root}{why}.")
    for q, problems in passed:
        what = f"the step {LATEST_FILE} names" if q.name == LATEST_FILE else q.name
        print(
            f"paratrain: warning: using {found.name}, an older step than the newest: passed over {what}: "
            f"{'; '.join(problems)}",
            file=sys.stderr,
        )
    return Path(found)


def load_full_model(
    step_dir: str | Path, verify: bool = True, keys: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The full (unsharded) model tensors of a committed checkpoint, by their original names, in one process
    (only ``keys`` when given, in that order: DCP then reads those tensors' pieces only).

    Verified first (checksums included) unless ``verify=False`` (the caller verified it:
    :func:`resolve_checkpoint`); DCP assembles every shard written by every rank, whatever the strategy and
    world size that wrote it. Raises :class:`ConfigError` naming what is wrong.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    p = Path(step_dir)
    problems = check_checkpoint(p) if verify else []
    if problems:
        raise ConfigError(f"{p} is not a usable checkpoint: {'; '.join(problems)}")
    md = safe.read_metadata(p)
    model: dict[str, torch.Tensor] = {}
    for key, meta in md.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if keys is not None:
        model = {k: model[k] for k in keys}
    # DCP assembles every shard written by every rank into these full tensors (no process group needed).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        try:
            dcp.load(
                {"model": model},
                storage_reader=safe.SafeFileSystemReader(str(p)),
                planner=safe.SafeLoadPlanner(),
                no_dist=True,
            )
        except (Exception, CheckpointException) as e:  # DCP wraps every error in a CheckpointException
            damaged = safe.first_cause(e, safe.DamagedFileError)
            why = (
                f"file {damaged.file}): {damaged.reason}"
                if damaged
                else f"while reading): {type(e).__name__}"
            )
            raise ConfigError(f"checkpoint {p} is damaged ({why}") from None
    return model


def export_safetensors(step_dir: str | Path, out: str | Path, force: bool = False) -> dict[str, Any]:
    """Consolidate the model of a (sharded) checkpoint into one ``.safetensors`` file of full tensors.

    ``step_dir``: a step, checkpoint or run directory (:func:`resolve_checkpoint`, which verifies it,
    checksums included, and warns when the step used is not the newest). An existing ``out`` is refused unless ``force``
    (a directory never: it would be replaced by a file). The file is written to a temporary name and renamed.
    """
    from safetensors.torch import save_file

    p = Path(step_dir)
    dest = Path(out)
    if dest.is_dir():
        raise ConfigError(f"{dest} is a directory. Give the path of the .safetensors file to write.")
    if dest.exists() and not force:
        raise ConfigError(f"{dest} already exists. Give another path, or --force to overwrite it.")
    parent = next((d for d in dest.parents if d.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"cannot write {dest}: {parent} is a file, not a directory. Give another path.")
    p = resolve_checkpoint(p, flag="ckpt export")
    model = load_full_model(p, verify=False)
    state = _read_state(p)
    cfg = state.get("config", {})
    meta_out = {
        "step": str(state.get("step")),
        "strategy": str(state.get("strategy")),
        "model": json.dumps(cfg.get("model", {}) if isinstance(cfg, dict) else {}),
        "format": "pt",
    }
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.items()}, str(tmp), metadata=meta_out)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors writes 0600: give it a new file's usual mode
        os.replace(tmp, dest)
    except Exception as e:  # OSError, or safetensors' own error (a full disk while writing)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        why = (e.strerror or str(e)) if isinstance(e, OSError) else str(e).splitlines()[0][:200]
        raise ConfigError(f"cannot write {dest}: {why}. Give a writable path with free space.") from None
    return {
        "out": str(out),
        "tensors": len(model),
        "bytes": sum(t.numel() * t.element_size() for t in model.values()),
    }


def _umask() -> int:
    """The process umask (read by setting it and putting it back: there is no getter before Python 3.14)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def preflight_resume(
    cfg: RunConfig,
    meta_model: nn.Module,
    run_dir: str | Path | None = None,
    verify: bool = True,
    num_samples: int | None = None,
    reported: list[str] | None = None,
) -> Path | None:
    """The checkpoint the workers will resume from, checked against the model before any process starts.

    Raises :class:`ConfigError` listing every mismatch (missing/unexpected keys, shapes), or the problems of
    an explicitly given broken checkpoint. With ``--resume auto`` broken checkpoints are skipped (reported).
    ``verify``: compare checksums too (reads the checkpoint once; the workers verify again, split among ranks).
    ``num_samples``: the size of this run's training split; a checkpoint whose sampler position is in a
    dataset of another size is refused (the caller builds the dataset: this layer does not import ``data``).
    ``reported``: receives the absolute path of every checkpoint (or ``latest``) this warned about, so that
    the workers do not warn about it again.
    """
    mode = cfg.checkpoint.resume
    root = cfg.checkpoint.dir or (str(Path(run_dir) / "checkpoints") if run_dir else None)
    if mode == "never":
        earlier = [p for p in list_checkpoints(root) if (p / COMMIT_FILE).is_file()] if root else []
        if earlier:
            print(
                f"paratrain: warning: --resume never: {root} already holds {len(earlier)} checkpoint(s) of an "
                f"earlier run ({earlier[0].name}..{earlier[-1].name}). This run starts fresh and saves next to "
                "them, replacing any of the same step, and --keep-last counts them with its own (oldest commits "
                "first, so they are the first it deletes). Give a new "
                "--run-dir (or --ckpt-dir) to keep the runs apart.",
                file=sys.stderr,
            )
        return None
    if mode == "auto":
        if root is None:
            return None

        def skipped(p: Path, problems: list[str]) -> None:
            print(f"paratrain: warning: skipping checkpoint {p}: {'; '.join(problems)}", file=sys.stderr)
            if reported is not None:
                reported.append(os.path.abspath(p))

        path = find_latest_valid(root, on_skip=skipped, verify=verify)
        if path is None:
            return None
    else:
        path = Path(mode)
        problems = check_checkpoint(path, verify=verify)
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
    _check_same_optimizer(cfg, path)
    if num_samples is not None:
        _check_same_dataset_size(path, num_samples)
    _warn_restored_hyperparameters(cfg, path, md)
    return path


def _check_same_dataset_size(path: Path, num_samples: int) -> None:
    """The sampler resumes a position in a permutation of the training set: it needs the same set."""
    sampler = _read_state(path).get("sampler")
    saved = sampler.get("num_samples") if isinstance(sampler, dict) else None
    if isinstance(saved, int) and saved != num_samples:
        raise ConfigError(
            f"{path} was saved while training on {saved} samples, and this run's training split has "
            f"{num_samples} (the --data flags or data.* settings changed): its data position cannot resume in "
            "another dataset. Resume with the same data flags as the run that saved it, or start fresh with "
            "--resume never or another --ckpt-dir (--run-dir)."
        )


def _restored_hyperparameters(path: Path, md: Any) -> dict[str, Any]:
    """The optimizer hyper-parameters a resume restores from ``path`` (they replace the run's own): the base
    ``lr`` (the scheduler's ``base_lrs``, else the optimizer's ``initial_lr``) and each parameter group's
    ``weight_decay``, ``momentum``, ``betas`` as saved. Unreadable values are left out."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    out: dict[str, Any] = {}
    base_lrs = _read_state(path).get("scheduler", {}).get("base_lrs")
    if isinstance(base_lrs, list) and base_lrs:
        out["lr"] = base_lrs[0]
    wanted = {"initial_lr": "lr", "weight_decay": "weight_decay", "momentum": "momentum", "betas": "betas"}
    for fqn, meta in md.state_dict_metadata.items():
        key = fqn.rsplit(".", 1)[-1]
        name = wanted.get(key)
        if not (fqn.startswith("optim.param_groups.") and isinstance(meta, BytesStorageMetadata)) or not name:
            continue
        if name in out:
            continue
        with contextlib.suppress(Exception):  # damaged entries are the workers' to report
            value = safe.read_byte_entry(path, md, fqn)
            out[name] = [float(v) for v in value] if isinstance(value, list | tuple) else float(value)
    return out


def _warn_restored_hyperparameters(cfg: RunConfig, path: Path, md: Any) -> None:
    """The optimizer's state (param groups) and the LR scheduler's resume as saved: a changed ``--lr`` (or
    weight decay, momentum, betas) would be ignored. Say so once, in the launching process."""
    o = cfg.optimizer
    live: dict[str, Any] = {"lr": o.lr, "weight_decay": o.weight_decay}
    live.update({"momentum": o.momentum} if o.name == "sgd" else {"betas": [float(b) for b in o.betas]})
    saved = _restored_hyperparameters(path, md)

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return isinstance(a, float | int) and isinstance(b, float | int) and math.isclose(a, b, rel_tol=1e-6)

    def show(v: Any) -> str:
        return "(" + ", ".join(f"{x:g}" for x in v) + ")" if isinstance(v, list) else f"{v:g}"

    changed = [k for k in live if k in saved and not same(saved[k], live[k])]
    if not changed:
        return
    was = ", ".join(f"{k} {show(saved[k])}" for k in changed)
    now = ", ".join(f"{k} {show(live[k])}" for k in changed)
    print(
        f"paratrain: warning: resuming from {path}, saved with optimizer {was}; this run asks for {now}. The "
        "checkpoint's values win: the optimizer and its LR schedule resume as saved, and these settings are "
        "ignored. To train with them, start fresh (--resume never, in a new --run-dir or --ckpt-dir).",
        file=sys.stderr,
    )


def _check_same_optimizer(cfg: RunConfig, path: Path) -> None:
    """The optimizer's state (AdamW's moments, SGD's momentum) resumes only into the same optimizer."""
    config = _read_state(path).get("config")  # {} when damaged: the workers report it
    saved = config.get("optimizer") if isinstance(config, dict) else None
    name = saved.get("name") if isinstance(saved, dict) else None
    if isinstance(name, str) and name != cfg.optimizer.name:
        raise ConfigError(
            f"{path} was saved with --optimizer {name}, and this run uses --optimizer {cfg.optimizer.name}: "
            f"the optimizer state ({name}'s) cannot be loaded into another optimizer. Resume with "
            f"--optimizer {name}, or start fresh in a new --run-dir (--resume never)."
        )
