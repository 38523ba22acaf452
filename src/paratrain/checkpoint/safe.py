"""Loading DCP checkpoints without unpickling arbitrary objects.

Stock DCP reads ``.metadata`` with ``pickle.load`` and every non-tensor entry (optimizer ``param_groups``
values: lr, betas, ...) with ``torch.load(weights_only=False)``. A checkpoint directory handed to a
training job is untrusted input, so paratrain replaces both:

- :class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler that only resolves the handful of
  classes DCP's metadata is made of (``torch.distributed.checkpoint.metadata.*``, ``torch.Size``, dtypes,
  layouts); anything else raises :class:`UnsafeCheckpointError`;
- :class:`SafeLoadPlanner` loads byte entries with ``torch.load(weights_only=True)``.

Tensor entries are already read by DCP with ``weights_only=True``.

Reference: https://pytorch.org/docs/stable/notes/serialization.html#weights-only
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

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
    """``FileSystemReader`` whose ``read_metadata`` refuses anything but DCP's own metadata classes."""

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
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
