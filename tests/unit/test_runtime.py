"""runtime.init without torchrun, backend choice, seeding; registries."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import paratrain
from paratrain.config import DataConfig, ModelConfig
from paratrain.data import available_datasets, build_dataset
from paratrain.models import build_model
from paratrain.runtime import choose_backend, init, shutdown


def test_init_without_torchrun_is_world_size_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    ctx = init(device="cpu", seed=5)
    assert (ctx.rank, ctx.world_size, ctx.local_rank) == (0, 1, 0)
    assert ctx.backend is None and not ctx.distributed and ctx.is_main
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    init(device="cpu", seed=5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
    shutdown()
    shutdown()  # idempotent


def test_backend_choice_on_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only expectation")
    assert choose_backend("auto", "auto") == ("gloo", "cpu")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        choose_backend("nccl", "cpu")
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        choose_backend("auto", "cuda")


def test_digits_split_is_deterministic_and_disjoint() -> None:
    a, b = build_dataset(DataConfig()), build_dataset(DataConfig())
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    # 20% of 1797, rounded: a test split that does not divide by 2, 3 or 4 ranks
    assert (len(a.train), len(a.test)) == (1438, 359)
    assert a.input_shape == (1, 8, 8) and a.num_outputs == 10
    # a partition: train + test is exactly the dataset, as a multiset of (image, label) rows, so no sample is
    # in both splits (a sample copied into both, or one dropped, changes the multiset)
    from sklearn.datasets import load_digits

    raw = load_digits()
    x = (torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.3) / 0.4

    def rows(xs: torch.Tensor, ys: torch.Tensor) -> list[tuple[float, ...]]:
        return sorted((*r.flatten().tolist(), float(c)) for r, c in zip(xs, ys, strict=True))

    assert rows(torch.cat([a.train.x, a.test.x]), torch.cat([a.train.y, a.test.y])) == rows(
        x, torch.tensor(raw.target)
    )


def test_synthetic_datasets_are_learnable_shapes() -> None:
    assert {"digits", "synthetic-classification", "synthetic-regression"} <= set(available_datasets())
    reg = build_dataset(DataConfig(name="synthetic-regression", num_samples=100, num_features=4))
    assert reg.task == "regression" and reg.train.y.shape[1] == 1
    cls = build_dataset(DataConfig(name="synthetic-classification", num_samples=100, num_classes=3))
    assert cls.train.y.max() < 3


def test_models_forward_shapes() -> None:
    x = torch.randn(4, 1, 8, 8)
    assert build_model(ModelConfig(name="cnn"), (1, 8, 8), 10)(x).shape == (4, 10)
    assert build_model(ModelConfig(name="mlp"), (1, 8, 8), 10)(x).shape == (4, 10)
    with pytest.raises(ValueError, match="image inputs"):
        build_model(ModelConfig(name="cnn"), (32,), 10)


def test_public_api_exports() -> None:
    for name in ("init", "shutdown", "setup", "Context", "Trainer", "print0"):
        assert hasattr(paratrain, name), name
