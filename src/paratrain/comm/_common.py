"""Shared pieces of :mod:`paratrain.comm`: the group view, validation, reduction ops and p2p helpers.

Every algorithm module (``naive``, ``tree``, ``ring``, ``rhd``) talks to its peers only through
:class:`Peers`, which works in *group* ranks (0..size-1 inside ``group``) and translates to global ranks
at the last moment, because ``torch.distributed.isend``/``irecv`` address peers by global rank.

Point-to-point is always non-blocking (``isend``/``irecv``) and every algorithm waits explicitly on the
handles it needs, which is what makes the schedules deadlock-free: no rank ever blocks in a send while
its peer blocks in a send to it. Two ranks that send to each other in the same step go through
:meth:`Peers.exchange`, which on NCCL issues both ops as one ``batch_isend_irecv`` group (NCCL executes
ungrouped p2p on one stream in issue order, so a bare send/recv pair in opposite orders would deadlock).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")
"""Reduction ops. ``mean`` is ``sum`` divided by the group size, and only defined for float dtypes."""

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "broadcast": ("naive", "tree", "native"),
    "reduce": ("naive", "tree", "native"),
    "all_reduce": ("naive", "tree", "ring", "rhd", "native"),
    "all_gather": ("naive", "ring", "native"),
    "reduce_scatter": ("naive", "ring", "native"),
    "gather": ("naive", "native"),
    "scatter": ("naive", "native"),
}
"""Which algorithms each collective accepts; ``native`` is the backend's own collective."""

# Stable codes for the cross-rank consistency check (indices into these tuples).
_FUNCTIONS = tuple(ALGORITHMS)
_ALGOS = ("naive", "tree", "ring", "rhd", "native")
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
)  # fmt: skip
_MAX_CHECK_DIMS = 8


def _choices(value: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(value, list(choices), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"choose one of {', '.join(repr(c) for c in choices)}.{hint}"


def check_algorithm(function: str, algorithm: str) -> None:
    """Raise ``ValueError`` unless ``algorithm`` is one that ``function`` implements."""
    choices = ALGORITHMS[function]
    if algorithm not in choices:
        raise ValueError(f"{function}: unknown algorithm {algorithm!r}: {_choices(algorithm, choices)}")


def check_op(function: str, op: str, dtype: torch.dtype) -> None:
    """Raise for an unknown op (``ValueError``) or a dtype the op cannot reduce (``TypeError``)."""
    if op not in OPS:
        raise ValueError(f"{function}: unknown op {op!r}: {_choices(op, OPS)}")
    if dtype == torch.bool or dtype.is_complex or not (dtype.is_floating_point or _is_integer(dtype)):
        raise TypeError(f"{function}: op={op!r} reduces float and integer tensors, got dtype {dtype}.")
    if op == "mean" and not dtype.is_floating_point:
        raise TypeError(
            f"{function}: op='mean' needs a floating-point tensor, got {dtype} (the mean of integers is not "
            "an integer). Cast to a float dtype first, or use op='sum' and divide yourself."
        )


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def combine_(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """``acc = acc <op> other`` in place, without allocating. ``mean`` accumulates as ``sum``."""
    if op in ("sum", "mean"):
        acc.add_(other)
    elif op == "prod":
        acc.mul_(other)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    else:  # pragma: no cover - check_op ran first
        raise ValueError(op)


def combine_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    """``out = a <op> b`` (out of place into a pre-allocated ``out``)."""
    if op in ("sum", "mean"):
        torch.add(a, b, out=out)
    elif op == "prod":
        torch.mul(a, b, out=out)
    elif op == "max":
        torch.maximum(a, b, out=out)
    elif op == "min":
        torch.minimum(a, b, out=out)
    else:  # pragma: no cover
        raise ValueError(op)


def finish_mean_(tensor: torch.Tensor, op: str, size: int) -> None:
    """Turn a finished sum into a mean (a no-op for every other op)."""
    if op == "mean" and size > 1:
        tensor.div_(size)


def native_op(op: str) -> Any:
    """The ``dist.ReduceOp`` that a native collective runs for ``op`` (``mean`` runs SUM, then divides)."""
    return {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,  # Gloo has no AVG; SUM then div_ is the same on every backend
        "prod": dist.ReduceOp.PRODUCT,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }[op]


def wait_all(works: Iterable[Any]) -> None:
    """Wait on every handle (``None`` entries, which torch returns outside the group, are skipped)."""
    for w in works:
        if w is not None:
            w.wait()


@dataclass(frozen=True)
class Peers:
    """This rank's view of a group: its group rank, the group size, and p2p addressed by group rank."""

    group: Any
    """The ``group`` argument as given (``None``: the default group)."""
    pg: Any
    """The resolved ``ProcessGroup`` (``None`` without a process group)."""
    rank: int
    size: int
    batched: bool
    """Issue paired send/recv as one ``batch_isend_irecv`` (NCCL); Gloo issues them separately."""

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.GroupMember.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def group_rank(self, global_rank: int, what: str) -> int:
        """Translate a ``src``/``dst`` argument (a global rank, as in torch) into a group rank."""
        if self.group is None or self.group is dist.GroupMember.WORLD:
            if not 0 <= global_rank < self.size:
                raise ValueError(f"{what}={global_rank} is not a rank of a world of size {self.size}.")
            return global_rank
        try:
            return dist.get_group_rank(self.group, global_rank)
        except (ValueError, RuntimeError):
            members = [self.global_rank(r) for r in range(self.size)]
            raise ValueError(
                f"{what}={global_rank} is not in the group (global ranks {members}); like torch.distributed, "
                f"{what} is a global rank."
            ) from None

    # ``ProcessGroup.send``/``recv`` are what ``dist.isend``/``irecv`` call after their argument checks;
    # calling them directly (with group ranks) saves tens of microseconds per message, which matters
    # for the ring's pipelined pieces. Complex tensors travel as their real view, as in torch.
    def isend(self, tensor: torch.Tensor, to: int, tag: int = 0) -> Any:
        return self.pg.send([torch.view_as_real(tensor) if tensor.is_complex() else tensor], to, tag)

    def irecv(self, tensor: torch.Tensor, frm: int, tag: int = 0) -> Any:
        return self.pg.recv([torch.view_as_real(tensor) if tensor.is_complex() else tensor], frm, tag)

    def exchange(
        self,
        send: torch.Tensor | None,
        to: int,
        recv: torch.Tensor | None,
        frm: int,
        tag: int = 0,
    ) -> tuple[list[Any], list[Any]]:
        """Post a send and a receive together; return ``(send_works, recv_works)``.

        Empty or missing tensors are skipped (the peer skips the matching op, since it knows the size).
        On NCCL both ops form one group and share a single handle, so both lists hold that handle.
        """
        send = send if send is not None and send.numel() > 0 else None
        recv = recv if recv is not None and recv.numel() > 0 else None
        if self.batched and send is not None and recv is not None:
            ops = [
                dist.P2POp(dist.isend, send, group=self.group, tag=tag, group_peer=to),
                dist.P2POp(dist.irecv, recv, group=self.group, tag=tag, group_peer=frm),
            ]
            works = dist.batch_isend_irecv(ops)
            return works, works
        sends = [self.isend(send, to, tag)] if send is not None else []
        recvs = [self.irecv(recv, frm, tag)] if recv is not None else []
        return sends, recvs


def peers(function: str, group: Any) -> Peers:
    """Resolve ``group`` for this rank. Without a process group this is a world of size 1."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError(f"{function}: a group was given but no process group is initialised.")
        return Peers(None, None, 0, 1, False)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{function}: global rank {dist.get_rank()} is not a member of the given group; only members "
            "may call a collective on it."
        )
    pg = group if group is not None else dist.group.WORLD
    backend = str(dist.get_backend(group))
    return Peers(group, pg, rank, dist.get_world_size(group), backend != "gloo")


def contiguous_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor to run an in-place algorithm on: ``tensor`` itself, or a copy to write back."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def chunk_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of ``torch.tensor_split(range(total), parts)``.

    The first ``total % parts`` ranges are one longer; some are empty when ``total < parts``.
    """
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def default_device(peers: Peers) -> torch.device:
    """Where a rank that has no input tensor (scatter) puts its output: the backend's device."""
    if peers.batched and torch.cuda.is_available():  # NCCL (and other GPU backends) move CUDA tensors
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def check_consistent(
    peers: Peers, function: str, algorithm: str, op: str | None, root: int, tensor: torch.Tensor
) -> None:
    """Check that every rank of the group makes the same call: collective, algorithm, op, root, dtype, shape.

    A mismatch would otherwise deadlock, or (Gloo) abort the process on a size mismatch. The check is one
    native all-gather of 14 integers, run on the tensor's device (NCCL needs CUDA tensors); every rank
    sees the same table, so every rank raises the same ``ValueError``. Pass ``check=False`` to skip it in
    hot loops whose shapes are known to agree.
    """
    if peers.size == 1:
        return
    mine = torch.tensor(_signature(function, algorithm, op, root, tensor), dtype=torch.int64)
    table = torch.empty(peers.size * mine.numel(), dtype=torch.int64, device=tensor.device)
    dist.all_gather_single(table, mine.to(tensor.device), group=peers.group)
    rows = table.view(peers.size, -1).cpu().tolist()
    if all(row == rows[0] for row in rows):
        return
    lines = [f"rank {peers.global_rank(r)}: {_describe(row)}" for r, row in enumerate(rows)]
    raise ValueError(
        f"{function}: the ranks of the group disagree on the call (every rank must call the same collective "
        "with the same algorithm, op, root, dtype and shape):\n  " + "\n  ".join(lines)
    )
