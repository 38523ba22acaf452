"""Datasets and the resumable distributed batch sampler.

Every dataset is held in memory as tensors (:class:`TensorData`): the workloads paratrain ships are small,
and indexing a tensor is far cheaper than a DataLoader worker pool on a machine with few cores. A dataset is
registered under a name with :func:`register_dataset`; ``DataConfig.name`` picks it.
"""

from __future__ import annotations

from paratrain.config import DataConfig
from paratrain.data.batch import Batch
from paratrain.data.registry import REGISTRY as _REGISTRY
from paratrain.data.registry import (
    DatasetBuilder,
    Splits,
    TensorData,
    register_dataset,
    split_indices,
)
from paratrain.data.sampler import DistributedBatchSampler
from paratrain.errors import ConfigError, suggest
from paratrain.spec.catalog import DATASET_GROUP, plugins
from paratrain.spec.factory import is_import_path

__all__ = [
    "Batch",
    "DistributedBatchSampler",
    "Splits",
    "TensorData",
    "available_datasets",
    "build_dataset",
    "register_dataset",
    "split_indices",
]


def available_datasets() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


_BUILT_IN = ("digits", "synthetic-classification", "synthetic-regression")
"""Datasets the code makes or a package ships: a ``:PATH`` after their name would be ignored."""


def build_dataset(cfg: DataConfig, seed: int = 0) -> Splits:
    """The splits of ``cfg.name``: a registered dataset, or a user's factory ``pkg.module:factory``
    (:mod:`paratrain.data.user`; ``seed`` is offered to it)."""
    user = user_factory_path(cfg)
    if user is not None:
        from paratrain.data.user import build_user_dataset

        return build_user_dataset(user, cfg, seed)  # type: ignore[no-any-return]
    builder = get_dataset_builder(cfg.name)
    if cfg.name in _BUILT_IN and cfg.path:
        raise ConfigError(
            f"--data {cfg.name} takes no path, got {cfg.name}:{cfg.path}: it is built in and would ignore it. "
            f"Write --data {cfg.name}, or name a file-backed dataset (mnist:DIR, cifar10:DIR, text:PATH)."
        )
    return builder(cfg)


def user_factory_path(cfg: DataConfig) -> str | None:
    """``pkg.module:factory`` when ``cfg`` names a user's dataset factory, not a registered ``NAME[:PATH]``."""
    _load_builtin()
    if cfg.name in _REGISTRY:
        return None
    installed = plugins(DATASET_GROUP)  # entry points of installed packages (spec/catalog.py)
    if cfg.name in installed:
        return installed[cfg.name]
    full = f"{cfg.name}:{cfg.path}" if cfg.path is not None else cfg.name
    return full if is_import_path(full) else None


def get_dataset_builder(name: str) -> DatasetBuilder:
    """The builder registered as ``name``; :class:`ConfigError` with a suggestion otherwise."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown dataset {name!r}. {suggest(name, available_datasets())}")
    return _REGISTRY[name]


def _load_builtin() -> None:
    from paratrain.data import (  # noqa: F401  (registers)
        cifar,
        digits,
        jsonl,
        mnist,
        synthetic,
        text_datasets,
    )
