"""Reduction ops of :mod:`paratrain.comm`: validation, in-place combination, the native equivalent."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paratrain.errors import suggest

OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")
"""Reduction ops. ``mean`` is ``sum`` divided by the group size, and only defined for float dtypes."""


def check_op(function: str, op: str, dtype: torch.dtype) -> None:
    """Raise for an unknown op (``ValueError``) or a dtype the op cannot reduce (``TypeError``)."""
    if op not in OPS:
        raise ValueError(f"{function}: unknown op {op!r}: {suggest(op, OPS)}")
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
