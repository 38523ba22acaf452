"""Checkpoint, launcher and Slurm logic in one process (no process group)."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from paratrain.checkpoint import safe
from paratrain.checkpoint.inspect import export_safetensors, inspect_dir, preflight_resume
from paratrain.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    check_checkpoint,
    compare_state,
    find_latest_valid,
    list_checkpoints,
)
from paratrain.checkpoint.state import rng_state, set_rng_state
from paratrain.config import ConfigError, LaunchConfig, RunConfig
from paratrain.runtime import Context


def _ctx() -> Context:
    return Context(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        device=torch.device("cpu"),
        backend=None,
        timeout_s=30.0,
    )


def _model(hidden: int = 8) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    return m, opt


def _save_steps(
    root: Path, steps: list[int], keep_last: int | None = None
) -> tuple[CheckpointManager, nn.Module]:
    mgr = CheckpointManager(root, _ctx(), keep_last=keep_last)
    m, opt = _model()
    for s in steps:
        with torch.no_grad():
            m[0].weight.add_(1.0)
        mgr.save(s, m, opt, {"note": s}, rng_state())
    return mgr, m


def test_save_commit_latest_and_load_roundtrip(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, _ctx())
    m, opt = _model()
    for s in (2, 4):
        with torch.no_grad():
            m[0].weight.add_(1.0)
        m(torch.randn(5, 4)).sum().backward()
        opt.step()  # the saved optimizer state is the 2nd and 3rd step's, not a fresh model's
        mgr.save(s, m, opt, {"note": s}, rng_state())
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"
    assert not list(tmp_path.glob(".step_*"))  # the temporary directory became the final one
    assert check_checkpoint(tmp_path / "step_00000004") == []
    saved = opt.state_dict()
    m2, opt2 = _model()  # one step: its AdamW state (step 1, other moments) differs from the saved one
    assert float(opt2.state_dict()["state"][0]["step"]) == 1.0 and float(saved["state"][0]["step"]) == 3.0
    assert not torch.equal(opt2.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])
    loaded = mgr.load(tmp_path / "step_00000004", m2, opt2)
    assert loaded.train_state["step"] == 4 and loaded.train_state["note"] == 4
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    # every entry of the optimizer state is the saved one: the step counts and both moments of every parameter
    got = opt2.state_dict()
    assert set(got["state"]) == set(saved["state"]) == {0, 1, 2, 3}
    for i, st in saved["state"].items():
        assert set(got["state"][i]) == set(st), i
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    assert got["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"]
    assert torch.equal(got["state"][0]["exp_avg"], mgr_opt_state(tmp_path / "step_00000004"))


def mgr_opt_state(path: Path) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    md = safe.read_metadata(path)
    key = next(k for k in md.state_dict_metadata if k.endswith("0.weight.exp_avg"))
    t = torch.empty(md.state_dict_metadata[key].size)
    dcp.load({key: t}, storage_reader=safe.SafeFileSystemReader(str(path)), no_dist=True)
    return t


def test_truncated_and_partial_checkpoints_are_skipped(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2, 3])
    data = tmp_path / "step_00000003" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])  # truncated
    (tmp_path / "step_00000002" / "commit.json").unlink()  # partial (never committed)
    skipped: list[tuple[str, list[str]]] = []
    found = find_latest_valid(tmp_path, on_skip=lambda p, probs: skipped.append((p.name, probs)))
    assert found == tmp_path / "step_00000001"
    assert [s[0] for s in skipped] == ["step_00000003", "step_00000002"]
    assert "truncated" in skipped[0][1][0] and "partial" in skipped[1][1][0]
    m, opt = _model()
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointManager(tmp_path, _ctx()).load(tmp_path / "step_00000003", m, opt)


def test_retention_keeps_newest_and_ignores_saves_in_flight(tmp_path: Path) -> None:
    (tmp_path / ".step_00000009.tmp").mkdir(parents=True)  # a save being written by someone
    _save_steps(tmp_path, [1, 2, 3, 4], keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert (tmp_path / ".step_00000009.tmp").is_dir()
    # a newer checkpoint that is corrupt does not count: the newest *valid* one survives retention
    _save_steps(tmp_path, [5], keep_last=1)
    (tmp_path / "step_00000005" / "commit.json").unlink()
    _save_steps(tmp_path, [6], keep_last=1)
    assert (tmp_path / "step_00000006").is_dir() and check_checkpoint(tmp_path / "step_00000006") == []


def test_model_mismatch_lists_every_difference(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1])
    md = safe.read_metadata(tmp_path / "step_00000001")
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3), nn.Linear(3, 2))
    problems = compare_state(md, {k: v.shape for k, v in other.state_dict().items()})
    text = "\n".join(problems)
    assert "shape mismatch: 0.weight is (8, 4) in the checkpoint, (16, 4)" in text
    assert "shape mismatch: 2.weight" in text and "shape mismatch: 0.bias" in text
    assert "missing in checkpoint: 3.weight" in text and "missing in checkpoint: 3.bias" in text
    m, opt = _model(hidden=16)
    with pytest.raises(CheckpointError, match="mismatch") as err:
        CheckpointManager(tmp_path, _ctx()).load(tmp_path / "step_00000001", m, opt)
    assert str(err.value).count("shape mismatch") == 3  # 0.weight, 0.bias, 2.weight


def test_unpickler_refuses_foreign_classes(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1])
    safe.read_metadata(tmp_path / "step_00000001")  # the real thing loads

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("echo pwned > /dev/null",))

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(safe.UnsafeCheckpointError, match="system"):
        safe.read_metadata(bad)
    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_rng_roundtrip_every_stream() -> None:
    gen = torch.Generator().manual_seed(5)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in NumPy's state
    state = rng_state({"augment": gen})
    expect = (random.random(), np.random.standard_normal(), torch.rand(2), torch.rand(2, generator=gen))
    random.seed(9), np.random.seed(9), torch.manual_seed(9), gen.manual_seed(9)
    set_rng_state(state, {"augment": gen})
    got = (random.random(), np.random.standard_normal(), torch.rand(2), torch.rand(2, generator=gen))
    assert got[0] == expect[0] and got[1] == expect[1]
    assert torch.equal(got[2], expect[2]) and torch.equal(got[3], expect[3])


def test_export_and_inspect(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    _, m = _save_steps(tmp_path / "ck", [7])
    info = export_safetensors(tmp_path / "ck" / "step_00000007", tmp_path / "m.safetensors")
    with pytest.raises(ConfigError, match="m.safetensors is a file, not a directory"):
        export_safetensors(tmp_path / "ck" / "step_00000007", tmp_path / "m.safetensors" / "x.safetensors")
    out = load_file(str(tmp_path / "m.safetensors"))
    assert info["tensors"] == 4 and set(out) == set(m.state_dict())
    for k, v in m.state_dict().items():
        assert torch.equal(out[k], v)
    rep = inspect_dir(tmp_path / "ck")
    assert rep["latest"] == "step_00000007" and rep["checkpoints"][0]["valid"]
    assert rep["checkpoints"][0]["world_size"] == 1 and rep["checkpoints"][0]["bytes"] > 0


def test_preflight_resume_refuses_other_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from paratrain.models import build_model

    cfg = _mlp_config(tmp_path, [])
    mgr = CheckpointManager(tmp_path, _ctx())
    model = build_model(cfg.model, (32,), 10)
    mgr.save(1, model, torch.optim.AdamW(model.parameters()), {})
    assert preflight_resume(cfg, model) == tmp_path / "step_00000001"
    cfg.model.hidden = 12
    with torch.device("meta"):
        other = build_model(cfg.model, (32,), 10)
    with pytest.raises(ConfigError, match="mismatch") as err:
        preflight_resume(cfg, other)
    assert "(8, 32) in the checkpoint, (12, 32) in the model" in str(err.value)
    cfg.checkpoint.resume = "never"
    assert preflight_resume(cfg, other) is None


# ---- launcher and Slurm -------------------------------------------------------------------------------------
def test_slurm_detection_and_sbatch() -> None:
    from paratrain.launch import slurm

    assert slurm.expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "node[7-8]",
        "SLURM_GPUS_ON_NODE": "4",
    }
    launch = slurm.apply(LaunchConfig(), env)
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint, launch.rdzv_id, launch.nproc_per_node) == (
        "2",
        1,
        "node7:29500",
        "slurm-42",
        4,
    )
    explicit = LaunchConfig(rdzv_endpoint="h:1", nnodes="2")
    assert slurm.apply(explicit, env) is explicit  # flags given explicitly win
    assert slurm.apply(LaunchConfig(), {}) == LaunchConfig()  # outside Slurm: nothing changes
    text = slurm.sbatch_script(2, 4, ["train.py", "--lr", "0.1"])
    for needle in (
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=4",
        "scontrol show hostnames",
        "srun",
        "--nproc-per-node 4",
        '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"',
        "train.py --lr 0.1",
    ):
        assert needle in text


def test_cli_prints_sbatch(capsys: pytest.CaptureFixture[str]) -> None:
    from paratrain.cli import main

    assert main(["launch", "--slurm", "--nodes", "3", "--gpus-per-node", "2", "train.py", "--x", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and "#SBATCH --nodes=3" in out and "train.py --x 1" in out


def test_cli_sbatch_passes_the_agents_flags_on_and_refuses_the_ones_it_sets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from paratrain.cli import main

    argv = ["launch", "--slurm", "--nodes", "2", "--gpus-per-node", "2", "--cpu-bind", "cores",
            "--rdzv-conf", "last_call_timeout=5", "--guard", "--hang-timeout", "30", "train.py", "--x", "1"]  # fmt: skip
    assert main(argv) == 0
    srun = capsys.readouterr().out.split("srun ", 1)[1]
    for needle in ("--cpu-bind cores \\", "--rdzv-conf last_call_timeout=5 \\", "--guard \\",
                   "--hang-timeout 30.0 \\", "train.py --x 1"):  # fmt: skip
        assert needle in srun, srun
    assert srun.index("--cpu-bind") < srun.index("train.py")  # the agent's flags, not the script's
    # paratrain train as the agent takes them too
    assert main(["launch", "--slurm", "--cpu-bind", "cores", "train", "--strategy", "zero3"]) == 0
    srun = capsys.readouterr().out.split("srun ", 1)[1]
    assert "paratrain train" in srun and srun.index("--cpu-bind cores") < srun.index("--strategy zero3")
    # flags the script sets itself from the allocation: refused, naming what to give instead
    for flags, instead in ((["--nnodes", "3"], "give --nodes"), (["--nproc-per-node", "2"], "give --gpus-per-node"),
                           (["--rdzv-endpoint", "h:1"], "leave it out"), (["--master-port", "1234"], "leave it out")):  # fmt: skip
        assert main(["launch", "--slurm", *flags, "train.py"]) == 2
        err = capsys.readouterr().err
        assert flags[0] in err and instead in err, err
    assert main(["launch", "--slurm", "--guard", "train"]) == 2
    assert "Put train's flags after `train`" in capsys.readouterr().err
    # --device is an agent's flag under launch too (a CPU job on GPU nodes)
    assert main(["launch", "--slurm", "--device", "cpu", "train.py"]) == 0
    srun = capsys.readouterr().out.split("srun ", 1)[1]
    assert "--device cpu \\" in srun and srun.index("--device cpu") < srun.index("train.py"), srun


def test_launch_config_standalone_is_loopback_and_multinode_needs_endpoint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from paratrain.launch import LOOPBACK_BACKEND
    from paratrain.launch.agent import _elastic_config

    c = _elastic_config(LaunchConfig(), 2)
    assert c.rdzv_backend == LOOPBACK_BACKEND and c.rdzv_endpoint.startswith("127.0.0.1:")
    # a loopback endpoint (several agents on one machine) keeps every store on loopback too
    for host in ("127.0.0.1", "localhost", "127.0.0.2"):
        m = _elastic_config(LaunchConfig(nnodes="2", node_rank=1, rdzv_endpoint=f"{host}:2999"), 1)
        assert m.rdzv_backend == LOOPBACK_BACKEND and m.rdzv_configs["is_host"] is False and m.min_nodes == 2
    assert "no authentication" not in capsys.readouterr().err
    # a network endpoint: torch's c10d store, with one warning that it is unauthenticated
    n = _elastic_config(LaunchConfig(nnodes="2", node_rank=1, rdzv_endpoint="10.1.2.3:2999"), 1)
    assert n.rdzv_backend == "c10d" and "no authentication" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="rdzv-endpoint"):
        _elastic_config(LaunchConfig(nnodes="1:2"), 1)


def test_preflight_train_checks() -> None:
    from paratrain.launch import preflight_train
    from paratrain.parallel import get_strategy

    strategy = get_strategy("ddp")
    cfg = RunConfig().override(["launch.nproc_per_node=2", "launch.fail_at_step=3", "launch.fail_rank=2"])
    with pytest.raises(ConfigError, match="fail-rank 2 does not exist"):
        preflight_train(cfg, 2, strategy)
    cfg = RunConfig().override(
        [
            "launch.nproc_per_node=1",
            "launch.nnodes=2:3",
            "train.batch_size=64",
            "launch.rdzv_endpoint=h:1",
            "train.run_dir=/tmp/x",
        ]
    )
    with pytest.raises(ConfigError, match="at 3 node"):
        preflight_train(cfg, 2, strategy)
    cfg = RunConfig().override(["launch.nproc_per_node=1", "launch.nnodes=2", "launch.rdzv_endpoint=h:1"])
    with pytest.raises(ConfigError, match="run directory shared"):
        preflight_train(cfg, 2, strategy)


def test_commit_manifest_lists_every_file(tmp_path: Path) -> None:
    _save_steps(tmp_path, [3])
    step = tmp_path / "step_00000003"
    files = json.loads((step / "commit.json").read_text())["files"]
    on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file()} - {"commit.json"}
    assert set(files) == on_disk and ".metadata" in files and "rng/rank_00000.pt" in files


def _mlp_config(tmp_path: Path, overrides: list[str]) -> RunConfig:
    """A tiny mlp run on synthetic data that checkpoints into ``tmp_path``."""
    return RunConfig().override(
        [
            "model.name=mlp",
            "model.hidden=8",
            "data.name=synthetic-classification",
            f"checkpoint.dir={tmp_path}",
            *overrides,
        ]
    )


def test_preflight_resume_refuses_another_optimizer(tmp_path: Path) -> None:
    from paratrain.models import build_model

    cfg = _mlp_config(tmp_path, [])
    model = build_model(cfg.model, (32,), 10)
    CheckpointManager(tmp_path, _ctx()).save(
        1, model, torch.optim.AdamW(model.parameters()), {"config": {"optimizer": {"name": "adamw"}}}
    )
    assert preflight_resume(cfg, model) == tmp_path / "step_00000001"  # the same optimizer: fine
    cfg.optimizer.name = "sgd"
    with pytest.raises(ConfigError, match="saved with --optimizer adamw, and this run uses --optimizer sgd"):
        preflight_resume(cfg, model)


def _saved_by_a_run(tmp_path: Path, overrides: list[str]) -> RunConfig:
    """One checkpoint as the trainer saves it (its optimizer, scheduler and config), for preflight tests."""
    from paratrain.checkpoint.state import jsonable
    from paratrain.models import build_model
    from paratrain.train.trainer import build_optimizer, build_scheduler

    cfg = _mlp_config(tmp_path, overrides)
    model = build_model(cfg.model, (32,), 10)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, 10)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    sched.step()
    state = {"scheduler": jsonable(sched.state_dict()), "config": cfg.to_dict()}
    CheckpointManager(tmp_path, _ctx()).save(1, model, opt, state)
    return cfg


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_preflight_resume_warns_once_that_the_checkpoint_hyperparameters_win(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], optimizer: str
) -> None:
    from paratrain.models import build_model

    cfg = _saved_by_a_run(tmp_path, [f"optimizer.name={optimizer}", "optimizer.lr=0.003"])
    model = build_model(cfg.model, (32,), 10)
    assert preflight_resume(cfg, model) == tmp_path / "step_00000001"
    assert "warning" not in capsys.readouterr().err  # nothing changed: nothing said
    cfg.optimizer.lr = 1e-4
    cfg.optimizer.weight_decay = 0.1
    assert preflight_resume(cfg, model) == tmp_path / "step_00000001"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (
        "saved with optimizer lr 0.003, weight_decay 0; this run asks for lr 0.0001, weight_decay 0.1"
        in err[0]
    )
    assert "The checkpoint's values win" in err[0] and "--resume never" in err[0]
    cfg.optimizer.lr, cfg.optimizer.weight_decay = 0.003, 0.0
    if optimizer == "sgd":
        cfg.optimizer.momentum = 0.5
        expect = "momentum 0.9; this run asks for momentum 0.5"
    else:
        cfg.optimizer.betas = (0.8, 0.999)
        expect = "betas (0.9, 0.999); this run asks for betas (0.8, 0.999)"
    preflight_resume(cfg, model)
    assert expect in capsys.readouterr().err


def test_preflight_resume_refuses_another_training_set_size(tmp_path: Path) -> None:
    from paratrain.data import DistributedBatchSampler, build_dataset
    from paratrain.models import build_model

    cfg = _mlp_config(tmp_path, [])
    data = build_dataset(cfg.data)
    sampler = DistributedBatchSampler(len(data.train), 16, 0, 1, seed=0, shuffle=True)
    model = build_model(cfg.model, data.input_shape, data.num_outputs)
    opt = torch.optim.AdamW(model.parameters())
    CheckpointManager(tmp_path, _ctx()).save(1, model, opt, {"sampler": sampler.state_dict()})
    assert preflight_resume(cfg, model, num_samples=len(data.train)) == tmp_path / "step_00000001"
    cfg = cfg.override(["data.test_fraction=0.3"])
    smaller = len(build_dataset(cfg.data).train)
    assert smaller < len(data.train)
    with pytest.raises(ConfigError) as err:
        preflight_resume(cfg, model, num_samples=smaller)
    msg = str(err.value)
    assert (
        f"saved while training on {len(data.train)} samples, and this run's training split has {smaller}"
        in msg
    )
    assert "same data flags" in msg and "--resume never" in msg and "\n" not in msg


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_export_follows_the_umask(tmp_path: Path, umask: int) -> None:
    _save_steps(tmp_path / "ck", [1])
    old = os.umask(umask)
    try:
        export_safetensors(tmp_path / "ck" / "step_00000001", tmp_path / "m.safetensors")
        (tmp_path / "plain").write_bytes(b"x")  # what the same process gives any new file
    finally:
        os.umask(old)
    mode = (tmp_path / "m.safetensors").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain").stat().st_mode & 0o777 == 0o666 & ~umask
