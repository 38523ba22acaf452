"""Per-rank RNG state as plain tensors, and the JSON training state.

Nothing here is pickled: RNG states become integer/byte tensors (saved with ``torch.save`` and read back
with ``weights_only=True``), and the training state (step, sampler position, scheduler, GradScaler, logged
losses, config) is JSON. So a checkpoint can be loaded from an untrusted source without running code.
"""

from __future__ import annotations

import io
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paratrain.checkpoint.integrity import DEFAULT_ALGORITHM, FileDigest, write_file_hashed
from paratrain.checkpoint.safe import DamagedFileError, describe_read_error

FORMAT_VERSION = 2
"""2: optimizer state flattened (``state.<fqn>.<key>``); 1: nested (still loaded)."""
"""Bumped when the layout of ``train_state.json`` or the rank files changes incompatibly."""


def rng_state(generators: dict[str, torch.Generator] | None = None) -> dict[str, torch.Tensor]:
    """Python, NumPy, torch CPU, the current CUDA device, and any named extra generators, as tensors."""
    np_state: Any = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        # position, has_gauss, and the cached gaussian (kept exactly as float64 bits)
        "numpy_pos": torch.tensor([int(np_state[2]), int(np_state[3])], dtype=torch.int64),
        "numpy_gauss": torch.tensor([float(np_state[4])], dtype=torch.float64),
        "python": torch.tensor(list(py_state[1]), dtype=torch.int64),
        "python_gauss": torch.tensor(
            [float("nan") if py_state[2] is None else py_state[2]], dtype=torch.float64
        ),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # current device: the one this rank pinned
    for name, gen in (generators or {}).items():
        state[f"gen.{name}"] = gen.get_state()
    return state


def set_rng_state(
    state: dict[str, torch.Tensor], generators: dict[str, torch.Generator] | None = None
) -> None:
    """Restore what :func:`rng_state` captured (CUDA only when this process uses CUDA)."""
    torch.set_rng_state(state["torch_cpu"])
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    pos, has_gauss = (int(v) for v in state["numpy_pos"].tolist())
    np.random.set_state(("MT19937", keys, pos, has_gauss, float(state["numpy_gauss"][0])))
    gauss = float(state["python_gauss"][0])
    random.setstate((3, tuple(int(v) for v in state["python"].tolist()), None if gauss != gauss else gauss))
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])
    for name, gen in (generators or {}).items():
        key = f"gen.{name}"
        if key in state:
            gen.set_state(state[key])


def rank_file(step_dir: str | Path, rank: int) -> Path:
    return Path(step_dir) / "rng" / f"rank_{rank:05d}.pt"


def save_rank_state(
    step_dir: str | Path, rank: int, tensors: dict[str, torch.Tensor], algorithm: str = DEFAULT_ALGORITHM
) -> tuple[str, FileDigest]:
    """Write this rank's tensors; returns ``(path relative to step_dir, size and checksum)``."""
    path = rank_file(step_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in tensors.items()}, buf)
    digest = write_file_hashed(path, buf.getbuffer(), algorithm)
    return path.relative_to(step_dir).as_posix(), digest


def load_rank_state(step_dir: str | Path, rank: int) -> dict[str, torch.Tensor] | None:
    """This rank's saved tensors, or ``None`` when the checkpoint has no file for this rank.

    Raises :class:`~paratrain.checkpoint.safe.DamagedFileError` (one line, never torch's unpickling advice) for a file that holds
    anything but tensors, or RNG states of the wrong type or shape.
    """
    path = rank_file(step_dir, rank)
    if not path.is_file():
        return None
    return read_rank_file(step_dir, path.relative_to(step_dir).as_posix())


def read_rank_file(step_dir: str | Path, rel: str) -> dict[str, torch.Tensor]:
    """Read and check one ``rng/rank_R.pt`` (``rel``: its path inside ``step_dir``); see :func:`load_rank_state`."""
    try:
        obj = torch.load(Path(step_dir) / rel, weights_only=True, map_location="cpu")
    except Exception as e:
        raise DamagedFileError(rel, describe_read_error(e)) from None
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise DamagedFileError(rel, "does not hold a dict of named tensors")
    problems = check_rng_state(obj)
    if problems:
        raise DamagedFileError(rel, "; ".join(problems))
    return obj


# name -> (dtype, shape or None for any 1-D length); what ``rng_state`` writes
_RNG_LAYOUT: dict[str, tuple[torch.dtype, tuple[int, ...] | None]] = {
    "torch_cpu": (torch.uint8, None),
    "cuda": (torch.uint8, None),
    "numpy_keys": (torch.int64, (624,)),
    "numpy_pos": (torch.int64, (2,)),
    "numpy_gauss": (torch.float64, (1,)),
    "python": (torch.int64, (625,)),
    "python_gauss": (torch.float64, (1,)),
}


def check_rng_state(state: dict[str, torch.Tensor]) -> list[str]:
    """Problems with the RNG entries of a rank state (other entries are the caller's business)."""
    out = []
    for name, t in state.items():
        layout = _RNG_LAYOUT.get(name, (torch.uint8, None) if name.startswith("gen.") else None)
        if layout is None:
            continue
        dtype, shape = layout
        if t.dtype != dtype or t.dim() != 1 or (shape is not None and tuple(t.shape) != shape):
            out.append(f"RNG state {name!r} is {t.dtype} {tuple(t.shape)}, not {dtype} {shape or '(n,)'}")
            continue
        if name in ("torch_cpu",) or name.startswith("gen."):
            try:
                torch.Generator().set_state(t)  # validates length and content without touching global RNG
            except RuntimeError:
                out.append(f"RNG state {name!r} is not a torch generator state")
        elif name in ("numpy_keys", "python") and bool(((t < 0) | (t >= 2**32)).any()):
            out.append(f"RNG state {name!r} holds values outside 32 bits")
        elif name == "numpy_pos" and not (0 <= int(t[0]) <= 624 and int(t[1]) in (0, 1)):
            out.append("RNG state 'numpy_pos' is out of range")
    if "python" in state and not out and not 0 <= int(state["python"][-1]) <= 624:
        out.append("RNG state 'python' has an out-of-range position")
    return out


TRAIN_STATE_FILE = "train_state.json"


def _is_int(v: Any, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def check_train_state(state: Any, step: int | None = None) -> list[str]:
    """Type problems in a decoded ``train_state.json``; ``step``: the step its directory name says.

    The manager writes ``step``, ``world_size`` and ``format``; the training loop adds the other keys
    checked here (each checked when present, so the manager's own tests can save free-form state).
    """
    if not isinstance(state, dict):
        return [f"holds a JSON {type(state).__name__}, not an object"]
    out = []

    def bad(key: str, want: str) -> None:
        out.append(f"{key!r} must be {want}, got {state.get(key)!r:.60}")

    if not _is_int(state.get("step")):
        bad("step", "an integer >= 0")
    elif step is not None and state["step"] != step:
        out.append(f"says step {state['step']}, its directory says step {step}")
    if not _is_int(state.get("world_size"), 1):
        bad("world_size", "an integer >= 1")
    if not _is_int(state.get("format"), 1):
        bad("format", "an integer >= 1")
    elif state["format"] > FORMAT_VERSION:
        out.append(
            f"has format {state['format']}, newer than this paratrain ({FORMAT_VERSION}): "
            "upgrade paratrain to load it"
        )
    if "sampler" in state:
        sampler = state["sampler"]
        if not isinstance(sampler, dict):
            bad("sampler", "an object")
        else:
            for key, minimum in (
                ("epoch", 0),
                ("step", 0),
                ("seed", 0),
                ("num_samples", 1),
                ("global_batch_size", 1),
            ):
                if not _is_int(sampler.get(key), minimum):
                    out.append(
                        f"sampler {key!r} must be an integer >= {minimum}, got {sampler.get(key)!r:.60}"
                    )
            if not isinstance(sampler.get("shuffle", True), bool):
                out.append("sampler 'shuffle' must be true or false")
    for key in ("scheduler", "config"):
        if key in state and not isinstance(state[key], dict):
            bad(key, "an object")
    if isinstance(state.get("scheduler"), dict):
        out.extend(_check_scheduler(state["scheduler"]))
    if isinstance(state.get("config"), dict):
        out.extend(
            f"config section {name!r} must be an object, got {section!r:.60}"
            for name, section in state["config"].items()
            if not isinstance(section, dict)
        )
    if "scaler" in state and state["scaler"] is not None and not isinstance(state["scaler"], dict):
        bad("scaler", "an object or null")
    elif isinstance(state.get("scaler"), dict):
        out.extend(_check_scaler(state["scaler"]))
    if "losses" in state and not (
        isinstance(state["losses"], list)
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in state["losses"])
    ):
        bad("losses", "a list of numbers")
    if "strategy" in state and not isinstance(state["strategy"], str):
        bad("strategy", "a string")
    for key in ("dp_size", "num_params"):
        if key in state and not _is_int(state[key], 1 if key == "dp_size" else 0):
            bad(key, "a positive integer")
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_scheduler(sched: dict[str, Any]) -> list[str]:
    """What ``LambdaLR.load_state_dict`` (a plain ``__dict__.update``) would choke on later, in the middle of
    training: each field the scheduler saves must have its type (checked when present)."""
    out = []
    for key in ("base_lrs", "_last_lr"):
        if key in sched and not (
            isinstance(sched[key], list) and sched[key] and all(_is_number(v) and v >= 0 for v in sched[key])
        ):
            out.append(f"scheduler {key!r} must be a list of numbers >= 0, got {sched[key]!r:.60}")
    if "last_epoch" in sched and not _is_int(sched["last_epoch"], -1):
        out.append(f"scheduler 'last_epoch' must be an integer >= -1, got {sched['last_epoch']!r:.60}")
    if "_step_count" in sched and not _is_int(sched["_step_count"]):
        out.append(f"scheduler '_step_count' must be an integer >= 0, got {sched['_step_count']!r:.60}")
    for key in ("_is_initial", "_get_lr_called_within_step", "verbose"):
        if key in sched and not isinstance(sched[key], bool):
            out.append(f"scheduler {key!r} must be true or false, got {sched[key]!r:.60}")
    if "lr_lambdas" in sched and not (
        isinstance(sched["lr_lambdas"], list) and all(v is None for v in sched["lr_lambdas"])
    ):
        out.append(f"scheduler 'lr_lambdas' must be a list of nulls, got {sched['lr_lambdas']!r:.60}")
    if "optimizer" in sched:
        out.append("scheduler holds an 'optimizer' entry (it would replace the live optimizer)")
    lengths = {
        len(sched[k]) for k in ("base_lrs", "_last_lr", "lr_lambdas") if isinstance(sched.get(k), list)
    }
    if not out and len(lengths) > 1:
        out.append("scheduler 'base_lrs', '_last_lr' and 'lr_lambdas' have different lengths")
    return out


def _check_scaler(scaler: dict[str, Any]) -> list[str]:
    """The GradScaler's saved fields (checked when present)."""
    out = []
    for key in ("scale", "growth_factor", "backoff_factor"):
        if key in scaler and not (_is_number(scaler[key]) and scaler[key] > 0):
            out.append(f"scaler {key!r} must be a number > 0, got {scaler[key]!r:.60}")
    for key, minimum in (("growth_interval", 1), ("_growth_tracker", 0)):
        if key in scaler and not _is_int(scaler[key], minimum):
            out.append(f"scaler {key!r} must be an integer >= {minimum}, got {scaler[key]!r:.60}")
    return out


def read_train_state(step_dir: str | Path, step: int | None = None) -> dict[str, Any]:
    """Decode and check ``train_state.json``; :class:`~paratrain.checkpoint.safe.DamagedFileError` says what
    is wrong, in one line."""
    path = Path(step_dir) / TRAIN_STATE_FILE
    try:
        state = json.loads(path.read_bytes())
    except OSError as e:
        raise DamagedFileError(TRAIN_STATE_FILE, f"cannot be read ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        raise DamagedFileError(TRAIN_STATE_FILE, f"is not valid JSON ({str(e)[:120]})") from None
    problems = check_train_state(state, step)
    if problems:
        raise DamagedFileError(TRAIN_STATE_FILE, "; ".join(problems))
    return state  # type: ignore[no-any-return]


def write_train_state(
    step_dir: str | Path, state: dict[str, Any], algorithm: str = DEFAULT_ALGORITHM
) -> FileDigest:
    data = json.dumps(state, indent=1, sort_keys=True).encode()
    return write_file_hashed(Path(step_dir) / TRAIN_STATE_FILE, data, algorithm)


def jsonable(obj: Any) -> Any:
    """Scheduler/GradScaler state dicts to JSON values (tensors become lists, tuples lists)."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float | int | str | bool) or obj is None:
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in the JSON training state")
