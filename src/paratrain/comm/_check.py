"""Which algorithms each collective has, and the cross-rank check that every rank makes the same call."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm._common import Peers
from paratrain.comm._ops import OPS
from paratrain.config import COMM_ALGORITHMS
from paratrain.errors import suggest

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "broadcast": ("naive", "tree", "shm", "native"),
    "reduce": ("naive", "tree", "shm", "native"),
    "all_reduce": ("naive", "tree", "ring", "rhd", "shm", "native"),
    "all_gather": ("naive", "ring", "shm", "native"),
    "reduce_scatter": ("naive", "ring", "shm", "native"),
    "gather": ("naive", "native"),
    "scatter": ("naive", "native"),
    "all_to_all": ("pairwise", "native"),
}
"""Which algorithms each collective accepts; ``native`` is the backend's own collective, ``shm`` the
shared-memory transport of :mod:`paratrain.comm.shm` (the ranks of one host)."""

# Stable codes for the cross-rank consistency check (indices into these tuples).
_FUNCTIONS = tuple(ALGORITHMS)
_ALGOS = COMM_ALGORITHMS
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
)  # fmt: skip
_MAX_CHECK_DIMS = 8


def check_algorithm(function: str, algorithm: str) -> None:
    """Raise ``ValueError`` unless ``algorithm`` is one that ``function`` implements."""
    choices = ALGORITHMS[function]
    if algorithm not in choices:
        raise ValueError(f"{function}: unknown algorithm {algorithm!r}: {suggest(algorithm, choices)}")


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def dtype_from_code(code: int) -> torch.dtype:
    if not 0 <= code < len(_DTYPES):
        raise ValueError(f"unknown dtype code {code}")
    return _DTYPES[code]


def _signature(function: str, algorithm: str, op: str | None, root: int, tensor: torch.Tensor) -> list[int]:
    shape = list(tensor.shape)
    dims = shape[:_MAX_CHECK_DIMS] + [-1] * (_MAX_CHECK_DIMS - min(len(shape), _MAX_CHECK_DIMS))
    if len(shape) > _MAX_CHECK_DIMS:
        dims[-1] = hash(tuple(shape[_MAX_CHECK_DIMS - 1 :])) & 0x7FFFFFFFFFFF  # int hashes are not salted
    op_code = OPS.index(op) if op is not None else -1
    return [
        _FUNCTIONS.index(function),
        _ALGOS.index(algorithm),
        op_code,
        dtype_code(tensor.dtype),
        root,
        tensor.dim(),
        *dims,
    ]


def _describe(sig: list[int]) -> str:
    fn, alg, op, dt, root, ndim, *dims = sig
    shape = tuple(dims[: min(ndim, _MAX_CHECK_DIMS)])
    dtype = _DTYPES[dt] if 0 <= dt < len(_DTYPES) else "?"
    extra = f", op={OPS[op]!r}" if op >= 0 else ""
    return f"{_FUNCTIONS[fn]}(algorithm={_ALGOS[alg]!r}{extra}, root={root}, {dtype}, shape {shape})"


_VERIFIED: weakref.WeakKeyDictionary[Any, set[tuple[int, ...]]] = weakref.WeakKeyDictionary()
"""Per process group: the call signatures every rank of it has already made together (checked)."""


def verified_signatures(group: Any) -> int:
    """How many call signatures have been checked on ``group`` (its process group) so far."""
    return len(_VERIFIED.get(group, ()))


def check_consistent(
    peers: Peers, function: str, algorithm: str, op: str | None, root: int, tensor: torch.Tensor
) -> None:
    """Check that every rank of the group makes the same call: collective, algorithm, op, root, dtype, shape.

    A mismatch would otherwise deadlock, or (Gloo) abort the process on a size mismatch. The check is one
    native all-gather of 14 integers, run on the tensor's device (NCCL needs CUDA tensors); every rank
    sees the same table, so every rank raises the same ``ValueError``.

    Each signature is checked once per group: a call whose signature this rank already made together with
    every other rank of the group skips the all-gather, which would otherwise cost a latency-bound
    collective per call (up to a fifth of a 16 MB all-reduce on 4 CPU ranks). What that leaves: ranks that
    diverge between two signatures each checked before. A rank whose signature is new still checks, while
    the others run the algorithm: both sides then wait for each other and fail at the group's timeout
    (naming the rank that is not in the collective), never with mixed data. The ring over its own TCP
    links, where mismatched sizes could otherwise misalign the byte stream, also compares every call's
    layout with its left neighbour in its first message (:func:`paratrain.comm.ring._over_links`). Pass
    ``check=False`` to skip even the first check.
    """
    if peers.size == 1:
        return
    sig = _signature(function, algorithm, op, root, tensor)
    key = peers.pg if peers.pg is not None else peers.group
    try:
        seen = _VERIFIED.setdefault(key, set())
    except TypeError:  # not weakly referenceable: check every call
        seen = set()
    if tuple(sig) in seen:
        return
    mine = torch.tensor(sig, dtype=torch.int64)
    table = torch.empty(peers.size * mine.numel(), dtype=torch.int64, device=tensor.device)
    dist.all_gather_single(table, mine.to(tensor.device), group=peers.group)
    rows = table.view(peers.size, -1).cpu().tolist()
    if all(row == rows[0] for row in rows):
        seen.add(tuple(sig))
        return
    lines = [f"rank {peers.global_rank(r)}: {_describe(row)}" for r, row in enumerate(rows)]
    raise ValueError(
        f"{function}: the ranks of the group disagree on the call (every rank must call the same collective "
        "with the same algorithm, op, root, dtype and shape):\n  " + "\n  ".join(lines)
    )
