"""Record every ``torch.distributed`` collective that passes through Python: op, shapes, root, call site.

Each public collective (``dist.all_reduce``, ``dist.barrier``, ...) is replaced, in ``torch.distributed``
and in ``torch.distributed.distributed_c10d``, by a wrapper that writes one entry to this rank's record
(:mod:`record`) before calling the original, and marks it finished after. What is recorded:

- the sequence number within the process group (the N-th collective of a group on every rank is the one
  the backends pair up), and a crc32 of the *signature* (op, dtype, shape, root, reduce op) that must be
  equal on every rank; the call site is not in the signature, since ranks may legitimately reach the
  same collective from different lines;
- the user's call site: the innermost frame outside torch and paratrain, ``train.py:41``.

Collectives that torch issues from C++ (DDP's gradient buckets, functional collectives under DTensor) do
not pass through these functions and are not recorded. Nested calls (``all_gather_object`` calls
``all_gather``) are recorded once, as the outer call. The guard's own collectives are not recorded (:func:`unrecorded`).
Cost: under 10 µs of CPU per collective on a busy small CPU host (benchmarks/bench_guard.py), no system call.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from paratrain.diagnose.guard.record import SEP, RecordWriter

# op -> (the argument whose dtype and shape go into the signature, the arguments that must agree)
OPS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "all_reduce": ("tensor", ("op",)),
    "all_reduce_coalesced": ("tensors", ("op",)),
    "all_gather": ("tensor_list", ()),  # the outputs: the same on every rank, even when sizes are uneven
    "all_gather_into_tensor": ("input_tensor", ()),
    "reduce_scatter": ("input_list", ("op",)),
    "reduce_scatter_tensor": ("output", ("op",)),
    "broadcast": ("tensor", ("src", "group_src")),
    "reduce": ("tensor", ("dst", "op", "group_dst")),
    "gather": ("tensor", ("dst", "group_dst")),
    "scatter": ("tensor", ("src", "group_src")),
    "all_to_all_single": ("output", ()),
    "all_to_all": ("output_tensor_list", ()),
    "barrier": (None, ()),
    "monitored_barrier": (None, ()),
    "all_gather_object": (None, ()),
    "broadcast_object_list": ("object_list", ("src", "group_src")),
    "gather_object": (None, ("dst", "group_dst")),
    "scatter_object_list": (None, ("src", "group_src")),
}

_tls = threading.local()
_ACTIVE: Recorder | None = None
_MISSING = object()


@dataclass
class _Spec:
    name: str
    primary: tuple[int, str] | None
    keys: list[tuple[int, str, Any]]
    group: tuple[int, str] | None
    async_op: tuple[int, str] | None


def _at(index: dict[str, int], name: str | None) -> tuple[int, str] | None:
    return (index[name], name) if name is not None and name in index else None


def _tensor_text(x: Any) -> str:
    shape = getattr(x, "shape", None)
    if shape is not None:
        return f"{str(x.dtype).removeprefix('torch.')}[{','.join(str(d) for d in shape)}]"
    if isinstance(x, list | tuple):
        if x and getattr(x[0], "shape", None) is not None:
            return f"{len(x)}x{_tensor_text(x[0])}"
        return f"list[{len(x)}]"
    return type(x).__name__


def _value_text(v: Any) -> str:
    name = getattr(v, "name", None)
    return name if isinstance(name, str) else str(v)


class _Sites:
    """The user's call site: the innermost frame whose file is not inside torch or paratrain."""

    def __init__(self) -> None:
        import torch

        import paratrain

        self.prefixes = (
            os.path.dirname(torch.__file__) + os.sep,
            os.path.dirname(paratrain.__file__) + os.sep,
            "<frozen ",
        )
        self.internal: dict[str, bool] = {}
        self.short: dict[str, str] = {}
        self.cwd = os.getcwd() + os.sep

    def is_internal(self, filename: str) -> bool:
        v = self.internal.get(filename)
        if v is None:
            v = self.internal[filename] = filename.startswith(self.prefixes)
        return v

    def name(self, filename: str) -> str:
        s = self.short.get(filename)
        if s is None:
            s = filename[len(self.cwd) :] if filename.startswith(self.cwd) else os.path.basename(filename)
            self.short[filename] = s
        return s

    def user_frame(self, frame: Any) -> Any:
        while frame is not None and self.is_internal(frame.f_code.co_filename):
            frame = frame.f_back
        return frame


class Recorder:
    """Owns the per-group sequence numbers and writes entries to one rank's :class:`RecordWriter`."""

    def __init__(self, writer: RecordWriter) -> None:
        self.writer = writer
        self.sites = _Sites()
        self.originals: dict[str, Callable[..., Any]] = {}
        self._seq: dict[int, int] = {}
        self._chain: dict[int, int] = {}
        self._groups: dict[int, tuple[int, str] | None] = {}
        self._texts: dict[Any, tuple[bytes, int, bytes]] = {}
        self._lock = threading.Lock()
        self._patched: list[tuple[Any, str, Any]] = []

    # -- groups ------------------------------------------------------------------------------------------
    def _group(self, group: Any) -> tuple[int, str] | None:
        """``(gkey, "ranks")`` of a process group, ``(0, "")`` for the default one, ``None`` if not a member."""
        if group is None:
            return (0, "")
        found = self._groups.get(id(group), _MISSING)
        if found is _MISSING:
            import torch.distributed as dist

            if group is dist.GroupMember.WORLD:
                found = (0, "")
            elif group is dist.GroupMember.NON_GROUP_MEMBER:
                found = None
            else:
                try:
                    ranks = ",".join(str(r) for r in dist.get_process_group_ranks(group))
                    found = (zlib.crc32(str(getattr(group, "group_name", ranks)).encode()) or 1, ranks)
                except Exception:
                    found = None
            self._groups[id(group)] = found
        return found  # type: ignore[return-value]

    # -- one collective -----------------------------------------------------------------------------------
    def _describe(self, spec: _Spec, x: Any, keyvals: tuple[Any, ...], uneven: bool) -> str:
        text = spec.name
        extra = [
            f"{name}={_value_text(v)}" for (_, name, d), v in zip(spec.keys, keyvals, strict=True) if v != d
        ]
        if extra:
            text += f"({','.join(extra)})"
        if uneven:
            text += f" {str(getattr(x, 'dtype', '')).removeprefix('torch.')}[uneven]"
        elif x is not None:
            text += f" {_tensor_text(x)}"
        return text

    def enter(self, spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Write the entry; returns the slot, or -1 when this call is not recorded.

        The hot path: the signature and the encoded entry text are cached per (op, call site, dtype, shape,
        root, group), so a training loop's repeated collectives cost a dict lookup and two ``pack_into``."""
        n = len(args)
        g = (args[spec.group[0]] if spec.group[0] < n else kwargs.get("group")) if spec.group else None
        group = (0, "") if g is None else self._group(g)
        if group is None:
            return -1
        # a default argument (the usual reduce op) is kept as the default object itself: ``is`` instead of
        # hashing or comparing a pybind enum on the hot path
        keyvals = (
            tuple([args[i] if i < n else kwargs.get(k, d) for i, k, d in spec.keys]) if spec.keys else ()
        )
        hashed = (
            tuple([None if v is d else v for v, (_, _, d) in zip(keyvals, spec.keys, strict=True)])
            if keyvals
            else ()
        )
        x = (
            (args[spec.primary[0]] if spec.primary[0] < n else kwargs.get(spec.primary[1]))
            if spec.primary
            else None
        )
        uneven = spec.name == "all_to_all_single" and any(
            (args[i] if i < n else kwargs.get(k)) is not None
            for i, k in ((2, "output_split_sizes"), (3, "input_split_sizes"))
        )
        is_async = (
            bool(args[spec.async_op[0]] if spec.async_op[0] < n else kwargs.get("async_op", False))
            if spec.async_op
            else False
        )
        frame = self.sites.user_frame(sys._getframe(1))
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if isinstance(x, list | tuple) and x and getattr(x[0], "shape", None) is not None:
            shape, dtype = (len(x), x[0].shape), x[0].dtype  # a list of tensors: cached by its first one
        key: Any = None
        if x is None or shape is not None:
            key = (
                spec.name,
                frame.f_code if frame else None,
                frame.f_lineno if frame else 0,
                dtype,
                shape,
                hashed,
                group[0],
                uneven,
            )
        try:
            cached = self._texts.get(key) if key is not None else None
        except TypeError:  # an unhashable argument (a custom reduce op): describe it every time
            key, cached = None, None
        if cached is None:
            text = self._describe(spec, x, keyvals, uneven)
            site = f"{self.sites.name(frame.f_code.co_filename)}:{frame.f_lineno}" if frame else "?"
            raw = text.encode()
            cached = (raw, zlib.crc32(raw), f"{text}{SEP}{site}{SEP}{group[1]}".encode()[:192])
            if key is not None and len(self._texts) < 4096:
                self._texts[key] = cached
        raw, sig, entry = cached
        gkey = group[0]
        with self._lock:
            seq = self._seq[gkey] = self._seq.get(gkey, 0) + 1
            chain = self._chain[gkey] = zlib.crc32(raw, self._chain.get(gkey, 0))
            return self.writer.enter(seq, gkey, sig, chain, entry, is_async)

    def exit(self, slot: int, ok: bool) -> None:
        with self._lock:
            self.writer.exit(slot, ok)

    # -- patching ----------------------------------------------------------------------------------------
    def install(self) -> None:
        global _ACTIVE
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, (primary, keys) in OPS.items():
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            params = list(inspect.signature(fn).parameters.values())
            index = {p.name: i for i, p in enumerate(params)}

            spec = _Spec(
                name,
                _at(index, primary),
                [(index[k], k, params[index[k]].default) for k in keys if k in index],
                _at(index, "group"),
                _at(index, "async_op"),
            )
            self.originals[name] = fn
            wrapper = _wrap(fn, spec)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    self._patched.append((module, name, fn))
                    setattr(module, name, wrapper)
        _ACTIVE = self

    def uninstall(self) -> None:
        global _ACTIVE
        for module, name, fn in reversed(self._patched):
            setattr(module, name, fn)
        self._patched.clear()
        _ACTIVE = None


def _wrap(fn: Callable[..., Any], spec: _Spec) -> Callable[..., Any]:
    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        rec = _ACTIVE
        if rec is None or getattr(_tls, "busy", False):
            return fn(*args, **kwargs)
        _tls.busy = True
        try:
            slot = rec.enter(spec, args, kwargs)
            if slot < 0:
                return fn(*args, **kwargs)
            try:
                out = fn(*args, **kwargs)
            except BaseException:
                rec.exit(slot, ok=False)
                raise
            rec.exit(slot, ok=True)
            return out
        finally:
            _tls.busy = False

    collective.__paratrain_guard__ = True  # type: ignore[attr-defined]
    return collective


@contextmanager
def unrecorded() -> Iterator[None]:
    """The guard's own collectives: not recorded, not numbered (every rank issues them at the same point)."""
    before = getattr(_tls, "busy", False)
    _tls.busy = True
    try:
        yield
    finally:
        _tls.busy = before


def active() -> Recorder | None:
    return _ACTIVE
