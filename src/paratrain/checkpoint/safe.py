"""Loading DCP checkpoints without unpickling arbitrary objects.

Stock DCP reads ``.metadata`` with ``pickle.load`` and every non-tensor entry (optimizer ``param_groups``
values: lr, betas, ...) with ``torch.load(weights_only=False)``. A checkpoint directory handed to a
training job is untrusted input, so paratrain replaces both:

- :class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler that only resolves the handful of
  classes DCP's metadata is made of (``torch.distributed.checkpoint.metadata.*``, ``torch.Size``, dtypes,
  layouts); anything else raises :class:`UnsafeCheckpointError`;
- :class:`SafeLoadPlanner` loads byte entries with ``torch.load(weights_only=True)`` and refuses a value
  whose type differs from the one the model's optimizer holds (a tampered ``lr`` that became a string);
- anything that goes wrong while reading a file becomes :class:`DamagedFileError` naming the file, in one
  line: never torch's advice to retry with ``weights_only=False``.

Tensor entries are already read by DCP with ``weights_only=True``.

Reference: https://pytorch.org/docs/stable/notes/serialization.html#weights-only
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_E = TypeVar("_E", bound=BaseException)

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The metadata names a class outside DCP's metadata vocabulary (a tampered or foreign file)."""


class DamagedFileError(Exception):
    """A checkpoint file that does not read back as what paratrain wrote. Picklable (DCP gathers it)."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(file, reason)
        self.file = file
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


def describe_read_error(e: BaseException) -> str:
    """One line for an error raised while deserializing untrusted bytes."""
    if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e):
        return "it holds pickled objects other than tensors and plain values (refused: nothing is unpickled)"
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def causes(e: BaseException, depth: int = 0) -> Iterator[BaseException]:
    """``e``, the per-rank errors inside a DCP ``CheckpointException`` (lowest rank first), then causes and
    contexts: DCP wraps every rank's error, with its traceback, into one exception raised on all ranks."""
    if depth > 8:
        return
    yield e
    if isinstance(e, CheckpointException):
        for _, (exc, _tb) in sorted(e.failures.items()):
            yield from causes(exc, depth + 1)
    for nxt in (e.__cause__, e.__context__):
        if nxt is not None:
            yield from causes(nxt, depth + 1)


def first_cause(e: BaseException, kind: type[_E]) -> _E | None:
    return next((c for c in causes(e) if isinstance(c, kind)), None)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's metadata format; "
            "refusing to unpickle it (the file may be tampered with or not a paratrain checkpoint)"
        )


def read_metadata(path: str | Path) -> Metadata:
    """Read ``PATH/.metadata`` with the restricted unpickler."""
    with open(Path(path) / ".metadata", "rb") as f:
        md = _RestrictedUnpickler(f).load()
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(f"{path}/.metadata does not hold DCP Metadata (got {type(md).__name__})")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` refuses anything but DCP's own metadata classes, and
    whose read errors name the file being read."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._reading = "?"

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self._reading = str(sinfo.relative_path)  # DCP reads one file at a time, on the calling thread
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except DamagedFileError:
            raise
        except Exception as e:
            raise DamagedFileError(self._reading, describe_read_error(e)) from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(Path(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        assert md.storage_meta is not None
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        file = "?"
        if self.metadata is not None and self.metadata.storage_data:
            info = self.metadata.storage_data.get(read_item.storage_index)
            file = str(getattr(info, "relative_path", "?"))
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise DamagedFileError(file, f"entry {fqn}: {describe_read_error(e)}") from None
        problem = _type_problem(obj, self.state_dict.get(fqn))
        if problem:
            raise DamagedFileError(file, f"entry {fqn} {problem}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, list | tuple):
        return "sequence"
    return type(v).__name__


def _type_problem(loaded: Any, current: Any) -> str | None:
    """Why ``loaded`` cannot replace ``current`` (the value the live optimizer/model holds), or ``None``."""
    if current is None or loaded is None:
        return None  # e.g. ``foreach: None``; an unset destination takes what was saved
    want, got = _kind(current), _kind(loaded)
    if want != got:
        return f"holds a {got} ({loaded!r:.40}) where this run has a {want}"
    if want == "sequence" and len(loaded) != len(current):
        return f"holds {len(loaded)} values where this run has {len(current)}"
    if want == "sequence":
        for a, b in zip(loaded, current, strict=True):
            problem = _type_problem(a, b)
            if problem:
                return problem
    return None


_NUMBER_ENTRIES = ("lr", "initial_lr", "weight_decay", "eps", "momentum", "dampening")
"""Optimizer hyper-parameters (the last part of a ``param_groups`` entry's name) that must be numbers."""


def check_byte_entries(step_dir: str | Path, md: Metadata, files: set[str] | None = None) -> list[str]:
    """Problems of the non-tensor entries (optimizer ``param_groups``) of a checkpoint, without a model: each
    is read with ``torch.load(weights_only=True)`` (what :class:`SafeLoadPlanner` does when loading) and a
    learning rate, weight decay, ... must be a number. ``files``: only entries stored in these files (a
    rank's share). The type check against the live optimizer remains the loader's."""
    out: list[str] = []
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(meta, BytesStorageMetadata):
            continue
        info = (md.storage_data or {}).get(MetadataIndex(fqn))
        rel = str(getattr(info, "relative_path", "?"))
        if info is None or (files is not None and rel not in files):
            continue
        try:
            obj = read_byte_entry(step_dir, md, fqn)
        except Exception as e:
            out.append(str(DamagedFileError(rel, f"entry {fqn}: {describe_read_error(e)}")))
            continue
        if fqn.rsplit(".", 1)[-1] in _NUMBER_ENTRIES and _kind(obj) not in ("number", "Tensor"):
            out.append(
                str(DamagedFileError(rel, f"entry {fqn} holds a {_kind(obj)} ({obj!r:.40}), not a number"))
            )
    return out


def read_byte_entry(step_dir: str | Path, md: Metadata, fqn: str) -> Any:
    """One non-tensor entry of a checkpoint (e.g. ``optim.param_groups.<param>.lr``), read with
    ``torch.load(weights_only=True)``; ``KeyError`` when the checkpoint has no such entry."""
    info = (md.storage_data or {})[MetadataIndex(fqn)]
    with open(Path(step_dir) / str(info.relative_path), "rb") as f:
        f.seek(int(info.offset))
        raw = f.read(int(info.length))
    return torch.load(io.BytesIO(raw), weights_only=True)
