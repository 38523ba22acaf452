"""CIFAR-10 binary and MNIST IDX loaders on small files written here; augmentation; model/feature helpers."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from paratrain.config import ConfigError, DataConfig, ModelConfig, RunConfig
from paratrain.data import build_dataset
from paratrain.data.cifar import MEAN, RECORD_BYTES, STD
from paratrain.data.transforms import crop_flip, random_crop, random_hflip
from paratrain.models import build_model, count_parameters
from paratrain.parallel.bucketed import plan_buckets
from paratrain.parallel.layers import choose_sync_batchnorm, convert_sync_batchnorm, count_batchnorm
from paratrain.parallel.parallelize import apply_activation_checkpointing, preflight_features


def write_cifar(path: Path, labels: np.ndarray, images: np.ndarray) -> None:
    """Records of the CIFAR-10 binary format: label byte, then R, G, B planes of 32x32 bytes."""
    rec = np.concatenate(
        [labels.astype(np.uint8)[:, None], images.reshape(len(labels), -1).astype(np.uint8)], axis=1
    )
    path.write_bytes(rec.tobytes())


def write_idx(path: Path, arr: np.ndarray, gz: bool = False) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if gz else data)


def test_cifar10_binary_roundtrip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, (n, 3, 32, 32)) for n in (20, 12)]
    labs = [rng.integers(0, 10, n) for n in (20, 12)]
    write_cifar(tmp_path / "data_batch_1.bin", labs[0], imgs[0])
    write_cifar(tmp_path / "data_batch_2.bin", labs[1], imgs[1])
    test_imgs, test_labs = rng.integers(0, 256, (8, 3, 32, 32)), rng.integers(0, 10, 8)
    write_cifar(tmp_path / "test_batch.bin", test_labs, test_imgs)
    s = build_dataset(DataConfig(name=f"cifar10:{tmp_path}"))
    assert s.input_shape == (3, 32, 32) and s.num_outputs == 10
    assert len(s.train) == 32 and len(s.test) == 8
    assert s.train.y.tolist() == np.concatenate(labs).tolist()
    # pixel (c, h, w) of image i is byte 1 + c*1024 + h*32 + w of record i, normalised per channel
    raw = np.concatenate(imgs)
    expect = (torch.tensor(raw[5, 2, 7, 30] / 255.0) - MEAN[2]) / STD[2]
    assert torch.isclose(s.train.x[5, 2, 7, 30], expect.float(), atol=1e-6)
    assert torch.equal(s.test.y, torch.tensor(test_labs))


def test_cifar10_errors_and_split(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no data_batch"):
        build_dataset(DataConfig(name=f"cifar10:{tmp_path}"))
    (tmp_path / "data_batch_1.bin").write_bytes(b"\x00" * (RECORD_BYTES + 5))
    with pytest.raises(ConfigError, match="multiple of the 3073-byte record"):
        build_dataset(DataConfig(name=f"cifar10:{tmp_path}"))
    nested = tmp_path / "x" / "cifar-10-batches-bin"
    nested.mkdir(parents=True)
    write_cifar(nested / "data_batch_1.bin", np.arange(50) % 10, np.zeros((50, 3, 32, 32)))
    s = build_dataset(DataConfig(name=f"cifar10:{tmp_path / 'x'}", test_fraction=0.2))  # no test_batch: split
    assert len(s.train) + len(s.test) == 50 and len(s.test) == 10
    with pytest.raises(ConfigError, match="does not exist"):
        build_dataset(DataConfig(name=f"cifar10:{tmp_path / 'missing'}"))


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx(tmp_path: Path, gz: bool) -> None:
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 256, (30, 28, 28)), rng.integers(0, 10, 30)
    sfx = ".gz" if gz else ""
    write_idx(tmp_path / f"train-images-idx3-ubyte{sfx}", x, gz)
    write_idx(tmp_path / f"train-labels-idx1-ubyte{sfx}", y, gz)
    write_idx(tmp_path / f"t10k-images-idx3-ubyte{sfx}", x[:6], gz)
    write_idx(tmp_path / f"t10k-labels-idx1-ubyte{sfx}", y[:6], gz)
    s = build_dataset(DataConfig(name=f"mnist:{tmp_path}"))
    assert s.input_shape == (1, 28, 28) and len(s.train) == 30 and len(s.test) == 6
    assert s.train.y.tolist() == y.tolist()
    assert torch.isclose(
        s.train.x[3, 0, 10, 11], torch.tensor((x[3, 10, 11] / 255.0 - 0.1307) / 0.3081).float()
    )


def test_mnist_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lacks train-images"):
        build_dataset(DataConfig(name=f"mnist:{tmp_path}"))
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((4, 28, 28)))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(5))
    with pytest.raises(ConfigError, match="expected"):
        build_dataset(DataConfig(name=f"mnist:{tmp_path}"))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x09abc")  # truncated
    with pytest.raises(ConfigError, match="truncated"):
        build_dataset(DataConfig(name=f"mnist:{tmp_path}"))
    with pytest.raises(ConfigError, match="needs a directory"):
        build_dataset(DataConfig(name="mnist"))


def _mnist_dir(root: Path, n: int = 6, test_hw: int = 28, label: int = 3) -> Path:
    root.mkdir()
    y = np.full(n, label)
    write_idx(root / "train-images-idx3-ubyte", np.zeros((n, 28, 28)))
    write_idx(root / "train-labels-idx1-ubyte", y)
    write_idx(root / "t10k-images-idx3-ubyte", np.zeros((2, test_hw, test_hw)))
    write_idx(root / "t10k-labels-idx1-ubyte", np.zeros(2))
    return root


def test_mnist_damaged_files_are_one_config_error(tmp_path: Path) -> None:
    """Each gets a ConfigError naming the problem (before: numpy/zlib/torch errors, a traceback), or, for a
    label outside 0-9, no longer a silently wider model."""
    header_only = _mnist_dir(tmp_path / "hdr")
    (header_only / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03")  # magic, no dimension words
    with pytest.raises(ConfigError, match="header ends after 4 bytes"):
        build_dataset(DataConfig(name=f"mnist:{header_only}"))
    bad_gz = _mnist_dir(tmp_path / "gz")
    (bad_gz / "train-images-idx3-ubyte").unlink()
    (bad_gz / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"x" * 100)[:12] + b"\xff" * 30)
    with pytest.raises(ConfigError, match="cannot be read"):
        build_dataset(DataConfig(name=f"mnist:{bad_gz}"))
    with pytest.raises(ConfigError, match="hold 0 images"):
        build_dataset(DataConfig(name=f"mnist:{_mnist_dir(tmp_path / 'zero', n=0)}"))
    with pytest.raises(
        ConfigError, match=r"t10k images are \(14, 14\) but the training images are \(28, 28\)"
    ):
        build_dataset(DataConfig(name=f"mnist:{_mnist_dir(tmp_path / 'hw', test_hw=14)}"))
    with pytest.raises(ConfigError, match="holds label 200"):
        build_dataset(DataConfig(name=f"mnist:{_mnist_dir(tmp_path / 'label', label=200)}"))


def test_cifar_batch_name_that_is_a_directory(tmp_path: Path) -> None:
    write_cifar(tmp_path / "data_batch_1.bin", np.arange(20) % 10, np.zeros((20, 3, 32, 32)))
    (tmp_path / "data_batch_2.bin").mkdir()
    with pytest.raises(ConfigError, match="data_batch_2.bin.*cannot be read"):
        build_dataset(DataConfig(name=f"cifar10:{tmp_path}"))


def test_augmentations() -> None:
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).view(2, 3, 4, 4)
    g = torch.Generator().manual_seed(0)
    # a crop of the padded image is the original shifted: every non-zero value is the original at some offset
    out = random_crop(1)(x, g)
    assert out.shape == x.shape
    for i in range(2):
        hits = [
            (dy, dx)
            for dy in range(3)
            for dx in range(3)
            if torch.equal(out[i], torch.nn.functional.pad(x[i], (1, 1, 1, 1))[:, dy : dy + 4, dx : dx + 4])
        ]
        assert hits
    flipped = random_hflip(1.0)(x, g)
    assert torch.equal(flipped, x.flip(-1)) and torch.equal(random_hflip(0.0)(x, g), x)
    a = crop_flip(2)(x, torch.Generator().manual_seed(5))
    b = crop_flip(2)(x, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)  # randomness only from the generator


def test_resnet_models() -> None:
    r18 = build_model(ModelConfig(name="resnet18", channels=8), (3, 32, 32), 10)
    r34 = build_model(ModelConfig(name="resnet34", channels=8), (3, 32, 32), 10)
    assert len(r18.blocks) == 8 and len(r34.blocks) == 16
    assert count_parameters(r34) > count_parameters(r18)
    assert count_batchnorm(r18) == 1 + 8 * 2 + 3  # stem, two per block, three projection shortcuts
    assert r18(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    std = build_model(ModelConfig(name="resnet18", channels=64), (3, 32, 32), 10)
    assert 11_000_000 < count_parameters(std) < 11_300_000  # the usual CIFAR ResNet-18: 11.17M parameters


def test_plan_buckets_reverse_order_and_caps() -> None:
    sizes = [400, 400, 400, 4000, 100]
    keys = ["f32"] * 5
    plan = plan_buckets(sizes, keys, cap_bytes=1000, first_cap_bytes=200)
    assert plan == [[4], [3], [2, 1], [0]]  # reverse order; first bucket capped at 200; big param alone
    assert plan_buckets(sizes, ["a", "b", "a", "b", "a"], cap_bytes=10**6, first_cap_bytes=10**6) == [
        [4, 2, 0],
        [3, 1],
    ]
    assert sorted(i for b in plan for i in b) == list(range(5))


def test_sync_batchnorm_choice_and_conversion() -> None:
    assert choose_sync_batchnorm(None, 3, 8, 2)[0] is True
    assert choose_sync_batchnorm(None, 3, 16, 2)[0] is False
    assert choose_sync_batchnorm(None, 3, 8, 1)[0] is False
    assert choose_sync_batchnorm(False, 3, 8, 2)[0] is False
    assert choose_sync_batchnorm(True, 3, 64, 2)[0] is True
    on, why = choose_sync_batchnorm(True, 0, 8, 2)
    assert not on and "no BatchNorm" in why
    model = build_model(ModelConfig(name="cnn", batchnorm=True, channels=4), (1, 8, 8), 10)
    params = list(model.parameters())
    model = convert_sync_batchnorm(model)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert sum(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()) == 4
    # world size 1 / no process group: behaves exactly like BatchNorm
    ref = build_model(ModelConfig(name="cnn", batchnorm=True, channels=4), (1, 8, 8), 10)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(6, 1, 8, 8)
    assert torch.allclose(model(x), ref(x), atol=1e-6)


def test_preflight_features() -> None:
    cfg = RunConfig()
    cfg.model.name, cfg.train.sync_batchnorm = "mlp", True
    mlp = build_model(cfg.model, (1, 8, 8), 10)
    warnings = preflight_features(cfg, mlp)
    assert len(warnings) == 1 and "no BatchNorm" in warnings[0]
    cfg.train.activation_checkpointing = True
    # mlp has blocks: no error, and checkpointing adds no warning of its own (only the BatchNorm one stays)
    assert preflight_features(cfg, mlp) == warnings
    cfg.train.sync_batchnorm = False
    assert preflight_features(cfg, mlp) == []
    with pytest.raises(ConfigError, match="has none"):
        preflight_features(cfg, torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="has none"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2))


def test_grad_accum_message() -> None:
    cfg = RunConfig()
    cfg.train.batch_size, cfg.train.grad_accum = 20, 3
    with pytest.raises(ConfigError, match=r"--grad-accum 3 does not divide the per-rank batch 10"):
        cfg.validate(2)


@pytest.mark.parametrize("name", ["digits", "synthetic-classification", "synthetic-regression"])
def test_a_path_after_a_built_in_dataset_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match=f"--data {name} takes no path"):
        build_dataset(DataConfig(name=f"{name}:{tmp_path}"))
