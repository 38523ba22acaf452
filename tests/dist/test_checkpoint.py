"""Checkpoints on real Gloo process groups: exact resume, signal stop, async save, resharding, dead peers.

The trainer runs in-process on every rank (``paratrain.worker.train``); references are computed in this
file: an uninterrupted run for exactness, and a plain single-process torch loop for resharding.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import RunConfig

pytestmark = pytest.mark.dist

STEPS, BATCH, SEED = 8, 24, 3


def _cfg(run_dir: Path, *extra: str) -> RunConfig:
    return RunConfig().override([
        "model.name=mlp", "model.hidden=16", "data.name=synthetic-classification", "data.num_samples=320",
        "data.num_features=8", f"train.steps={STEPS}", "train.epochs=none", f"train.batch_size={BATCH}",
        "train.log_every=3", f"train.seed={SEED}", "optimizer.lr=0.01", f"train.run_dir={run_dir}",
        "launch.timeout_s=30", "train.progress=false", *extra,
    ])


def _train(cfg: RunConfig) -> dict[str, Any]:
    from paratrain.runtime import init
    from paratrain.train.worker import train

    ctx = init("gloo", "cpu", cfg.launch.timeout_s, cfg.train.seed)
    return train(cfg, ctx, Path(cfg.train.run_dir)).summary()


def _signal_at(step: int, rank: int) -> Any:
    """Make ``rank`` send itself SIGUSR1 during step ``step`` (as a scheduler's preemption notice would)."""
    from paratrain.train.trainer import Trainer

    original = Trainer.train_step

    def patched(self: Trainer) -> torch.Tensor:
        if self.step + 1 == step and self.ctx.rank == rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        return original(self)

    Trainer.train_step = patched  # type: ignore[method-assign]
    return lambda: setattr(Trainer, "train_step", original)


def _resume_cases(tmp: str) -> dict[str, Any]:
    t = Path(tmp)
    drop = "model.dropout=0.2"  # dropout draws from the per-rank torch RNG: resume must restore it
    out: dict[str, Any] = {"uninterrupted": _train(_cfg(t / "u", drop, "checkpoint.every=4"))}
    undo = _signal_at(3, rank=1)
    out["stopped"] = _train(_cfg(t / "s", drop))
    undo()
    out["resumed"] = _train(_cfg(t / "s", drop))
    out["async"] = _train(_cfg(t / "a", drop, "checkpoint.every=2", "checkpoint.async_save=true"))
    out["async_resumed"] = _train(
        _cfg(t / "a2", drop, f"checkpoint.resume={t / 'a' / 'checkpoints' / 'step_00000004'}",
             "checkpoint.async_save=true"))
    out["reshard_src"] = _train(_cfg(t / "r", "train.steps=4"))
    return out


@pytest.mark.timeout(150)
def test_exact_resume_signal_stop_and_async(dist_run: Any, tmp_path: Path) -> None:
    from paratrain.checkpoint.manager import check_checkpoint, list_checkpoints

    r = dist_run(_resume_cases, 2, str(tmp_path), timeout_s=140)[0]
    u = r["uninterrupted"]
    # signal: both ranks stopped at the same step after a coordinated save, without evaluating
    s = r["stopped"]
    assert s["stopped_by_signal"] == "SIGUSR1" and 3 <= s["steps"] < STEPS and s["eval_accuracy"] is None
    assert r["resumed"]["resumed_from_step"] == s["steps"]
    # exact: same parameters bit for bit, and the full loss curve (not only the part after the resume)
    assert r["resumed"]["param_sha256"] == u["param_sha256"]
    assert r["resumed"]["losses"] == u["losses"] and len(u["losses"]) == STEPS
    # async saves do not perturb training; every one was committed; resuming from one is exact too
    assert r["async"]["param_sha256"] == u["param_sha256"]
    steps = [p.name for p in list_checkpoints(tmp_path / "a" / "checkpoints")]
    assert steps == ["step_00000002", "step_00000004", "step_00000006", "step_00000008"]
    assert all(check_checkpoint(tmp_path / "a" / "checkpoints" / n) == [] for n in steps)
    assert len(r["async"]["checkpoint_blocked_s"]) == 4
    assert r["async_resumed"]["param_sha256"] == u["param_sha256"]
    assert r["async_resumed"]["resumed_from_step"] == 4


def _reshard(src: str, run_dir: str, strategy: str) -> dict[str, Any]:
    return _train(_cfg(Path(run_dir), f"strategy.name={strategy}", f"checkpoint.resume={src}"))


def _reference_params(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Plain single-process torch: same init, the same global batches, AdamW, mean cross-entropy."""
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.runtime import seed_everything

    seed_everything(cfg.train.seed)
    data = build_dataset(cfg.data)
    model = build_model(cfg.model, data.input_shape, data.num_outputs)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    perm = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(cfg.train.seed))
    for t in range(STEPS):
        idx = perm[t * BATCH : (t + 1) * BATCH]
        loss = nn.functional.cross_entropy(model(data.train.x[idx]), data.train.y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.timeout(150)
def test_reshard_2_to_3_and_ddp_to_zero3(dist_run: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from paratrain.checkpoint.inspect import export_safetensors

    src = tmp_path / "src"
    dist_run(_train, 2, _cfg(src, "train.steps=4"), timeout_s=60)
    step4 = src / "checkpoints" / "step_00000004"
    ref = _reference_params(_cfg(src))
    for strategy in ("ddp", "zero3"):
        out = dist_run(_reshard, 3, str(step4), str(tmp_path / strategy), strategy, timeout_s=60)[0]
        assert out["world_size"] == 3 and out["resumed_from_step"] == 4 and out["steps"] == STEPS
        assert len(out["losses"]) == STEPS  # the curve saved at world size 2 is continued
        final = tmp_path / strategy / "checkpoints" / "step_00000008"
        export_safetensors(final, tmp_path / f"{strategy}.safetensors")
        got = load_file(str(tmp_path / f"{strategy}.safetensors"))
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{strategy}: {k}")


def _async_failure(tmp: str) -> str:
    os.environ["PARATRAIN_FAIL_CKPT_WRITE"] = "1"
    try:
        _train(_cfg(Path(tmp), "checkpoint.every=2", "checkpoint.async_save=true"))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(90)
def test_async_save_error_fails_every_rank(dist_run: Any, tmp_path: Path) -> None:
    from paratrain.checkpoint.manager import find_latest_valid

    errors = dist_run(_async_failure, 2, str(tmp_path), timeout_s=80)
    for rank, err in enumerate(errors):
        assert err.startswith("AsyncCheckpointError"), (rank, err)
    assert "injected checkpoint write failure on rank 1" in errors[1]
    assert find_latest_valid(tmp_path / "checkpoints") is None  # nothing half-written was committed


def _hung_peer() -> tuple[str, float]:
    from paratrain.runtime import init
    from paratrain.train.faults import PeerLostError, peer_guard

    ctx = init("gloo", "cpu", 30.0, 0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    t0 = time.monotonic()
    try:
        with peer_guard(ctx, interval_s=0.5) as mon:
            assert mon is not None
            if ctx.rank == 1:
                time.sleep(7)  # alive (heartbeats continue) but never reaches step 1's collective
                return "slept", 0.0
            mon.step = 1
            dist.all_reduce(torch.ones(1), group=group)
    except PeerLostError as e:
        return str(e), time.monotonic() - t0
    return "no error", 0.0


@pytest.mark.timeout(60)
def test_hung_peer_is_named_within_timeout(dist_run: Any) -> None:
    (msg, elapsed), _ = dist_run(_hung_peer, 2, timeout_s=40)
    assert "rank(s) [1] are alive but did not reach step 2" in msg, msg  # rank 0 finished step 1
    assert elapsed < 10, elapsed  # 3 s collective timeout + the heartbeat check, never a hang


def _unshared_roots(tmp: str) -> dict[str, str]:
    """In one process group, each mode in turn: every rank gives the manager its own directory
    (``unshared``: as on two nodes without shared storage; then ``unchecked``: the same with the check off),
    or the same one (``shared``)."""
    from paratrain.checkpoint import manager
    from paratrain.runtime import init

    manager.SHARED_ROOT_WAIT_S = 0.5
    ctx = init(seed=0)
    got: dict[str, str] = {}
    for mode, sub in (("unshared", "a"), ("shared", "b"), ("unchecked", "c")):
        root = Path(tmp) / sub / (f"node{ctx.rank}" if mode != "shared" else "both") / "checkpoints"
        try:
            m = manager.CheckpointManager(root, ctx, check_shared=mode != "unchecked")
        except manager.CheckpointError as e:
            got[mode] = f"CheckpointError: {e}"
            dist.barrier()
            continue
        dist.barrier()  # rank 0 has removed its probe
        probes = [p.name for p in root.glob(".shared-probe-*")] if root.exists() else []
        m.close()
        got[mode] = f"ok {probes}"
    return got


@pytest.mark.timeout(90)
def test_a_checkpoint_directory_the_ranks_do_not_share_fails_at_start_naming_them(
    dist_run: Any, tmp_path: Path
) -> None:
    ranks = dist_run(_unshared_roots, 2, str(tmp_path), timeout_s=80)
    for got in ranks:  # every rank raises the same error, at construction, before any step
        err = got["unshared"]
        assert err.startswith("CheckpointError: the checkpoint directory is not shared"), err
        assert f"rank 1 on {os.uname().nodename} ({tmp_path / 'a' / 'node1' / 'checkpoints'})" in err, err
        assert "rank 0 on" in err and str(tmp_path / "a" / "node0" / "checkpoints") in err
    assert [got["shared"] for got in ranks] == ["ok []"] * 2
    assert [got["unchecked"] for got in ranks] == ["ok []"] * 2
