"""Per-rank RNG state as plain tensors, and the JSON training state.

Nothing here is pickled: RNG states become integer/byte tensors (saved with ``torch.save`` and read back
with ``weights_only=True``), and the training state (step, sampler position, scheduler, GradScaler, logged
losses, config) is JSON. So a checkpoint can be loaded from an untrusted source without running code.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1
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


def save_rank_state(step_dir: str | Path, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    path = rank_file(step_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in tensors.items()}, path)


def load_rank_state(step_dir: str | Path, rank: int) -> dict[str, torch.Tensor] | None:
    """This rank's saved tensors, or ``None`` when the checkpoint has no file for this rank."""
    path = rank_file(step_dir, rank)
    if not path.is_file():
        return None
    obj = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} does not hold a dict of tensors")
    return obj


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
