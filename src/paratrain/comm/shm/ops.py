"""What a shared-memory call means: reduction ops (names, dtypes, the kernel) and the call signature that
every rank compares before it touches another rank's data (:mod:`paratrain.comm.shm`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod", "band", "bor", "bxor")
"""Reduction ops (``avg`` is accepted as ``mean``; ``dist.ReduceOp`` values are accepted too, and
``PREMUL_SUM`` made by ``torch.distributed._make_nccl_premul_sum(factor)``: each rank's input is
multiplied by the factor, then summed; :func:`split_premul`)."""

_FUNCS = ("all_reduce", "reduce", "reduce_scatter", "all_gather", "broadcast", "all_reduce_inplace_slot")
_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "complex32", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)  # fmt: skip
_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
)
"""Every dtype a call signature can name (its index is the code), so that ranks calling with different
dtypes of one size are told apart; new names go at the end."""


def normalize_op(op: Any) -> str:
    """``"sum"`` / ``dist.ReduceOp.SUM`` / ``"avg"`` ... → one of :data:`OPS`; ``ValueError`` otherwise."""
    if isinstance(op, str):
        name = {"avg": "mean", "product": "prod"}.get(op.lower(), op.lower())
        if name in OPS:
            return name
        raise ValueError(f"shm: unknown op {op!r}; choose one of {', '.join(OPS)} (or 'avg').")
    for name, native in (
        ("sum", "SUM"), ("mean", "AVG"), ("prod", "PRODUCT"), ("max", "MAX"), ("min", "MIN"),
        ("band", "BAND"), ("bor", "BOR"), ("bxor", "BXOR"), ("premul_sum", "PREMUL_SUM"),
    ):  # fmt: skip
        if op == getattr(dist.ReduceOp, native):
            return name
    raise ValueError(f"shm: unsupported reduce op {op!r} (custom ops are not implemented).")


def split_premul(op: Any) -> tuple[str, Any]:
    """``(name, factor)``: :func:`normalize_op`'s name, and for ``PREMUL_SUM`` its factor (a number or a
    one-element tensor) with the name ``"sum"`` (the caller multiplies each rank's input first); otherwise
    ``None``. A bare ``ReduceOp.PREMUL_SUM`` (no factor) is a ``ValueError``."""
    name = normalize_op(op)
    if name != "premul_sum":
        return name, None
    try:
        factor = op.factor
    except (AttributeError, RuntimeError):
        raise ValueError(
            "shm: ReduceOp.PREMUL_SUM needs its factor: make the op with "
            "torch.distributed._make_nccl_premul_sum(factor)."
        ) from None
    return "sum", factor


def premultiply(t: torch.Tensor, factor: Any, function: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t * factor`` into ``out`` (``t`` itself when ``out`` is ``t``; a new tensor when ``None``), for
    ``PREMUL_SUM``: floating-point and complex tensors only, as NCCL has it."""
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(f"{function}: PREMUL_SUM needs a floating-point tensor, got {t.dtype}.")
    if isinstance(factor, torch.Tensor):
        factor = factor.to(t.device).reshape(())
    return torch.mul(t, factor) if out is None else torch.mul(t, factor, out=out)


def native_op(op: str) -> Any:
    """The ``dist.ReduceOp`` equal to ``op`` (``mean`` is SUM; the caller divides)."""
    return getattr(
        dist.ReduceOp,
        {"sum": "SUM", "mean": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN", "band": "BAND",
         "bor": "BOR", "bxor": "BXOR"}[op],
    )  # fmt: skip


def check_op(function: str, op: str, dtype: torch.dtype) -> None:
    """``TypeError`` for a dtype ``op`` cannot reduce (the same combinations Gloo refuses)."""
    integral = dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)
    if op == "mean" and integral:
        raise TypeError(
            f"{function}: op='mean' needs a floating-point tensor, got {dtype} (the mean of integers is not "
            "an integer). Cast to a float dtype first, or use op='sum' and divide yourself."
        )
    if op in ("band", "bor", "bxor") and not integral:
        raise TypeError(f"{function}: op={op!r} needs an integer or bool tensor, got {dtype}.")
    if dtype.is_complex and op not in ("sum", "mean"):
        raise TypeError(f"{function}: op={op!r} is not defined for complex tensors ({dtype}).")
    missing = _kernel_missing(op, dtype)
    if missing is not None:
        raise TypeError(
            f"{function}: torch has no CPU kernel to reduce {dtype} tensors with op={op!r} ({missing}). "
            "Cast to a dtype it can reduce (float32, int64, ...) first."
        )


_KERNELS: dict[tuple[str, torch.dtype], str | None] = {}


def _kernel_missing(op: str, dtype: torch.dtype) -> str | None:
    """``None`` when torch's CPU kernels reduce ``dtype`` with ``op`` as the collectives do (tried once on
    a 2 × 2 tensor, then cached), else torch's message. Refused up front, a missing kernel cannot fail a
    collective halfway (which leaves the communicator unusable)."""
    key = (op, dtype)
    if key not in _KERNELS:
        try:
            rows, out = torch.zeros((2, 2), dtype=dtype), torch.empty(2, dtype=dtype)
            _reduce_rows(rows, out, op)
            binary = pairwise(op, dtype)
            if binary is not None:
                binary(rows[0], rows[1], out=out)
            if op == "mean":
                divide_(out, 3)
                divide_(out, 2)
            _KERNELS[key] = None
        except (NotImplementedError, RuntimeError, TypeError) as e:
            _KERNELS[key] = str(e).splitlines()[0][:200]
    return _KERNELS[key]


def divide_(t: torch.Tensor, n: int) -> None:
    """``t /= n`` in place (``mean``). For a real dtype a power of two multiplies by its exact reciprocal
    instead: the same result bit for bit (both are the correctly rounded x/n), at about half the time (a
    division unit is slower than a multiplier). Complex tensors divide (their product is not the same
    operation at infinities)."""
    if n & (n - 1) == 0 and not t.is_complex():
        t.mul_(1.0 / n)
    else:
        t.div_(n)


_BINARY: dict[str, Any] = {
    "sum": torch.add, "mean": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum,
}  # fmt: skip
_HALF = (torch.float16, torch.bfloat16)  # sums and products accumulate in float32 and round once


def pairwise(op: str, dtype: torch.dtype) -> Any:
    """The elementwise torch function that reduces two tensors for ``op`` (``torch.add``...), or ``None``
    where the reduction must see every row at once (sums and products of 16-bit floats, which accumulate
    in float32; bool; bitwise ops)."""
    if dtype == torch.bool or (dtype in _HALF and op in ("sum", "mean", "prod")):
        return None
    return _BINARY.get(op)


def _reduce_rows(rows: torch.Tensor, out: torch.Tensor, op: str) -> None:
    """``out = rows[0] <op> rows[1] <op> ...`` with one torch op where one exists; ``out`` must not alias
    ``rows``. Sums of bf16/fp16 accumulate in float32 (torch's CPU reduction does) and round once."""
    if rows.dtype == torch.bool:  # Gloo's bool semantics, on the 0/1 bytes
        rows, out = rows.view(torch.uint8), out.view(torch.uint8)
        op = {"sum": "max", "bor": "max", "prod": "min", "band": "min"}.get(op, op)
    integral = not (rows.dtype.is_floating_point or rows.dtype.is_complex)
    binary = _BINARY.get(op)
    if rows.shape[0] == 1:
        out.copy_(rows[0])
        return
    if binary is not None and pairwise(op, rows.dtype) is not None:
        # pairwise: torch's reduction over dim 0 of a strided (n, m) view runs at a fraction of the speed
        # of an elementwise op (measured 2.7x slower for n = 2); exact for integers (wrapping arithmetic is
        # associative), max and min; float sums may differ from torch.sum's order in the last bit
        binary(rows[0], rows[1], out=out)
        for j in range(2, rows.shape[0]):
            binary(out, rows[j], out=out)
        return
    if op in ("sum", "mean"):
        torch.sum(rows, 0, dtype=rows.dtype if integral else None, out=out)
    elif op == "prod":
        torch.prod(rows, 0, dtype=rows.dtype if integral else None, out=out)
    elif op == "max":
        torch.amax(rows, 0, out=out)
    elif op == "min":
        torch.amin(rows, 0, out=out)
    else:
        fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
        fn(rows[0], rows[1], out=out)
        for j in range(2, rows.shape[0]):
            fn(out, rows[j], out=out)


# call signatures (compared by every rank at the first step of a call)


def _esize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def _signature(
    function: str, op: str, dtype: torch.dtype, numel: int, root: int, aux: int, pieces: int
) -> list[int]:
    code = _DTYPES.index(dtype) if dtype in _DTYPES else 99
    return [0, _FUNCS.index(function), OPS.index(op) if op else -1, code, numel, root, aux, pieces]


def _with_seq(sig: list[int], seq: int) -> list[int]:
    return [seq, *sig[1:]]


def _bounds_hash(lens: Sequence[int]) -> int:
    return hash(tuple(lens)) & 0x7FFFFFFFFFFFFFFF  # hashes of ints and tuples of ints are not salted


def _describe(row: list[int]) -> str:
    seq, fn, op, dt, numel, root, aux, _ = row
    if not 0 <= fn < len(_FUNCS):
        return f"nothing at this step (step {seq})"
    dtype = _DTYPES[dt] if 0 <= dt < len(_DTYPES) else "?"
    parts = [f"{numel} elements of {dtype}"]
    if op >= 0:
        parts.insert(0, f"op={OPS[op]!r}")
    if root >= 0:
        parts.append(f"root (group rank) {root}")
    if fn == _FUNCS.index("all_reduce_inplace_slot"):
        parts.append(f"arena offset {aux}")
    if root == -2 or (fn == _FUNCS.index("broadcast") and aux == -2):
        parts.append("direct path")
    return f"{_FUNCS[fn]}({', '.join(parts)}) at step {seq}"
