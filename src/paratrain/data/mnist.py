"""MNIST from its IDX files (``--data mnist:DIR``), without torchvision.

IDX format (http://yann.lecun.com/exdb/mnist/): a 4-byte magic ``0x00 0x00 TYPE NDIM``, then ``NDIM``
big-endian uint32 dimension sizes, then the data in row-major order. MNIST uses TYPE ``0x08`` (unsigned
byte): images are ``(N, 28, 28)`` (magic 2051), labels ``(N,)`` (magic 2049). ``DIR`` holds
``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
``t10k-labels-idx1-ubyte``, each optionally gzipped (``.gz``), or an ``MNIST/raw`` folder with them.
Without the ``t10k`` pair a ``data.test_fraction`` share of the training set is held out.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paratrain.config import DataConfig
from paratrain.data.registry import Splits, TensorData, register_dataset, split_indices
from paratrain.data.transforms import normalize, random_crop
from paratrain.errors import ConfigError

_IDX_DTYPES: dict[int, np.dtype[Any]] = {
    code: np.dtype(t)
    for code, t in ((0x08, "u1"), (0x09, "i1"), (0x0B, ">i2"), (0x0C, ">i4"), (0x0D, ">f4"), (0x0E, ">f8"))
}
MEAN, STD = 0.1307, 0.3081


def read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file (plain or ``.gz``) into an array of its declared type and shape."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:  # a directory, a torn or garbled .gz (BadGzipFile: OSError)
        raise ConfigError(
            f"mnist: {str(path)!r} cannot be read ({type(e).__name__}: {e}). "
            "The file is truncated or corrupt; download it again."
        ) from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ConfigError(f"mnist: {str(path)!r} is not an IDX file (bad magic number {data[:4].hex()}).")
    dtype = _IDX_DTYPES[data[2]]
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ConfigError(
            f"mnist: {str(path)!r} declares {ndim} dimensions but its header ends after {len(data)} bytes "
            f"(needs {header}). The file is truncated or corrupt; download it again."
        )
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(data) - header != expected:
        raise ConfigError(
            f"mnist: {str(path)!r} declares shape {dims} ({expected} data bytes) but holds {len(data) - header}. "
            "The file is truncated or corrupt; download it again."
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)


def _find(root: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
        if (root / name).is_file():
            return root / name
    return None


def _pair(root: Path, prefix: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    images, labels = _find(root, f"{prefix}-images-idx3-ubyte"), _find(root, f"{prefix}-labels-idx1-ubyte")
    if images is None or labels is None:
        return None
    x, y = read_idx(images), read_idx(labels)
    if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ConfigError(
            f"mnist: {images.name} has shape {x.shape} and {labels.name} has shape {y.shape}; expected "
            "(N, H, W) images and N labels."
        )
    if y.size and (int(y.min()) < 0 or int(y.max()) > 9):
        bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
        raise ConfigError(
            f"mnist: {labels.name} holds label {bad}; MNIST labels are the digits 0-9. The file is corrupt or "
            "not MNIST's; download it again."
        )
    return torch.from_numpy(x.copy()), torch.from_numpy(y.astype(np.int64))


def load_mnist(
    path: str | None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
    """``(train, test)`` as raw images ``(N, H, W)`` and int64 labels; ``test`` is ``None`` if absent."""
    if not path:
        raise ConfigError(
            "dataset 'mnist' needs a directory: write --data mnist:DIR (DIR holds the IDX files)."
        )
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(
            f"mnist: directory {str(root)!r} does not exist. Pass the folder with the IDX files."
        )
    if _find(root, "train-images-idx3-ubyte") is None and (root / "MNIST" / "raw").is_dir():
        root = root / "MNIST" / "raw"
    train = _pair(root, "train")
    if train is None:
        raise ConfigError(
            f"mnist: {str(root)!r} lacks train-images-idx3-ubyte and train-labels-idx1-ubyte (plain or .gz). "
            "Download them from http://yann.lecun.com/exdb/mnist/ (or a mirror) into that folder."
        )
    if len(train[1]) == 0:
        raise ConfigError(f"mnist: the training files in {str(root)!r} hold 0 images. Download them again.")
    test = _pair(root, "t10k")
    if test is not None and test[0].shape[1:] != train[0].shape[1:]:
        raise ConfigError(
            f"mnist: the t10k images are {tuple(test[0].shape[1:])} but the training images are "
            f"{tuple(train[0].shape[1:])} (H, W) in {str(root)!r}; both must have one size. Replace the t10k "
            "files with the matching set, or remove them (a data.test_fraction share is held out instead)."
        )
    return train, test


@register_dataset("mnist")
def mnist(cfg: DataConfig) -> Splits:
    (xtr, ytr), test = load_mnist(cfg.path)
    if test is None:
        tr, te = split_indices(len(ytr), cfg.test_fraction)
        (xtr, ytr), (xte, yte) = (xtr[tr], ytr[tr]), (xtr[te], ytr[te])
    else:
        xte, yte = test

    def prep(x: torch.Tensor) -> torch.Tensor:
        return normalize(x.float().unsqueeze(1) / 255.0, [MEAN], [STD])

    num_classes = 10  # labels are checked to be digits 0-9 (_pair)
    return Splits(
        train=TensorData(prep(xtr), ytr, random_crop(2) if cfg.augment else None),
        test=TensorData(prep(xte), yte),
        task="classification",
        input_shape=(1, int(xtr.shape[1]), int(xtr.shape[2])),
        num_outputs=num_classes,
    )
