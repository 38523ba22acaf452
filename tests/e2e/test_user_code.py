"""A user's own model and data under ``paratrain train``: ``--model mypkg.models:build --data mypkg.data:build``
from the directory that holds ``mypkg`` (not installed), with the model's own tensor-parallel plan.
``fsdp+tp`` on 4 ranks trains it as ``single`` does (losses and parameters within float tolerance)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli

pytestmark = pytest.mark.e2e

MODELS = '''
"""A residual MLP written by a user, with its own tensor-parallel plan (Megatron's pair per block)."""
import torch
from torch import nn
from paratrain.models.spec import ModelSpec, attach_spec


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, features, classes, width=32, depth=2):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def tp_plan(model, sequence_parallel, loss_parallel):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    return plan


def build(input_shape, num_outputs, width=32):
    return attach_spec(Net(input_shape[0], num_outputs, width), ModelSpec(family="mypkg.Net", tp_plan=tp_plan))
'''

DATA = '''
"""A user's dataset: Gaussian inputs, labels from a fixed random linear map."""
import torch


def build(seed=0):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(640, 12, generator=g)
    y = (x @ torch.randn(12, 5, generator=g)).argmax(1)
    return {"train": (x[:512], y[:512]), "test": (x[512:], y[512:]), "task": "classification"}
'''


def _package(root: Path) -> None:
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "models.py").write_text(textwrap.dedent(MODELS))
    (root / "mypkg" / "data.py").write_text(textwrap.dedent(DATA))


@pytest.mark.timeout(420)
def test_user_model_and_data_train_under_fsdp_tp_like_single(tmp_path: Path) -> None:
    _package(tmp_path)
    common = ["train", "--model", "mypkg.models:build", "--data", "mypkg.data:build", "--steps", "4",
              "--batch-size", "32", "--set", "checkpoint.save_at_end=false", "--json"]  # fmt: skip
    single = last_json(
        run_cli(*common, "--strategy", "single", "--run-dir", "s", cwd=tmp_path, timeout=200).stdout
    )
    proc = run_cli(*common, "--strategy", "fsdp+tp", "--tp", "2", "--nproc-per-node", "4", "--run-dir", "f",
                   cwd=tmp_path, timeout=200)  # fmt: skip
    sharded = last_json(proc.stdout)
    # the summary gathers (_StridedShard, Shard) parameters: no DTensor '2 sequential all_gather' log line
    assert "sequential all_gather" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert sharded["topology"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}
    assert (
        single["num_params"]
        == sharded["num_params"]
        == 12 * 32 + 32 + 2 * (2 * 32 * 128 + 128 + 32) + 32 * 5 + 5
    )
    assert single["losses"][0] > single["losses"][-1]
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-5)
    assert sharded["param_norm"] == pytest.approx(single["param_norm"], rel=1e-5)
    assert sharded["eval_accuracy"] == pytest.approx(single["eval_accuracy"], abs=1 / 128 + 1e-9)


@pytest.mark.timeout(120)
def test_a_bad_factory_path_is_one_line_before_launch(tmp_path: Path) -> None:
    _package(tmp_path)
    proc = run_cli("train", "--model", "mypkg.modles:build", "--data", "mypkg.data:build", cwd=tmp_path,
                   check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--model mypkg.modles:build: no module named 'mypkg.modles'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("train", "--model", "mlp", "--data", "mypkg.data:nope", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "mypkg.data has no attribute 'nope'" in proc.stderr, proc.stderr
