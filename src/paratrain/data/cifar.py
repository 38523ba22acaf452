"""CIFAR-10 from its binary distribution (``--data cifar10:DIR``), without torchvision.

Format (https://www.cs.toronto.edu/~kriz/cifar.html, "binary version"): each file is a sequence of
3,073-byte records: one label byte (0..9), then 1,024 red, 1,024 green and 1,024 blue bytes of a 32x32
image in row-major order. ``data_batch_1.bin`` .. ``data_batch_5.bin`` are the training set (10,000
records each) and ``test_batch.bin`` the test set. ``DIR`` may hold the files directly or the extracted
``cifar-10-batches-bin/`` folder. Any non-empty subset of the training batches is accepted (small test
fixtures write just one); without ``test_batch.bin`` a ``data.test_fraction`` share of the training
records is held out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from paratrain.config import DataConfig
from paratrain.data.registry import Splits, TensorData, register_dataset, split_indices
from paratrain.data.transforms import crop_flip, normalize
from paratrain.errors import ConfigError

RECORD_BYTES = 1 + 3 * 32 * 32
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def _resolve_dir(path: str | None) -> Path:
    if not path:
        raise ConfigError(
            "dataset 'cifar10' needs a directory: write --data cifar10:DIR (DIR holds data_batch_*.bin)."
        )
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(
            f"cifar10: directory {str(root)!r} does not exist. Pass the folder with data_batch_*.bin."
        )
    nested = root / "cifar-10-batches-bin"
    if not list(root.glob("data_batch_*.bin")) and nested.is_dir():
        root = nested
    return root


def read_cifar_bin(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One binary batch file -> ``(uint8 images (N, 3, 32, 32), int64 labels (N,))``."""
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except OSError as e:  # a directory named like a batch file, an unreadable file
        raise ConfigError(
            f"cifar10: {str(path)!r} cannot be read ({type(e).__name__}: {e}). It must be a CIFAR-10 binary "
            "batch file; move whatever else is there out of the folder."
        ) from None
    if raw.size == 0 or raw.size % RECORD_BYTES:
        raise ConfigError(
            f"cifar10: {str(path)!r} has {raw.size} bytes, not a positive multiple of the {RECORD_BYTES}-byte "
            "record (1 label byte + 3072 pixel bytes). Is it the *binary* version of CIFAR-10?"
        )
    rec = raw.reshape(-1, RECORD_BYTES)
    labels = rec[:, 0].astype(np.int64)
    if labels.max() > 9:
        raise ConfigError(
            f"cifar10: {str(path)!r} has label {int(labels.max())} > 9. CIFAR-100 files have two label bytes; "
            "this loader reads CIFAR-10."
        )
    images = rec[:, 1:].reshape(-1, 3, 32, 32)
    return torch.from_numpy(images.copy()), torch.from_numpy(labels)


def load_cifar10(
    path: str | None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
    """``(train, test)`` as uint8 images and labels; ``test`` is ``None`` without ``test_batch.bin``."""
    root = _resolve_dir(path)
    train_files = sorted(root.glob("data_batch_*.bin"))
    if not train_files:
        raise ConfigError(
            f"cifar10: no data_batch_*.bin in {str(root)!r}. Download and extract cifar-10-binary.tar.gz "
            "from https://www.cs.toronto.edu/~kriz/cifar.html and pass the extracted folder."
        )
    parts = [read_cifar_bin(f) for f in train_files]
    train = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    test_file = root / "test_batch.bin"
    test = read_cifar_bin(test_file) if test_file.is_file() else None
    return train, test


def _to_float(images: torch.Tensor) -> torch.Tensor:
    return normalize(images.float() / 255.0, MEAN, STD)


@register_dataset("cifar10")
def cifar10(cfg: DataConfig) -> Splits:
    (xtr, ytr), test = load_cifar10(cfg.path)
    if test is None:
        tr, te = split_indices(len(ytr), cfg.test_fraction)
        (xtr, ytr), (xte, yte) = (xtr[tr], ytr[tr]), (xtr[te], ytr[te])
    else:
        xte, yte = test
    return Splits(
        train=TensorData(_to_float(xtr), ytr, crop_flip(4) if cfg.augment else None),
        test=TensorData(_to_float(xte), yte),
        task="classification",
        input_shape=(3, 32, 32),
        num_outputs=10,
    )
