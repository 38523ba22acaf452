"""Elastic membership change as a user meets it: two ``paratrain train`` agents form one job over loopback
(``--nnodes 1:2``, c10d rendezvous); one node dies; the other re-forms the job alone and finishes.

What is checked against what:

- the surviving agent's ``--json`` summary: it restarted (``restarts >= 1``), resumed from a committed
  checkpoint that was saved at world size 2, and finished every step at world size 1;
- the resumed part of its loss curve and its final parameters against an independent single-process
  reference: plain torch (AdamW, cross-entropy) started from that same checkpoint (read with torch's DCP API),
  fed global batch ``t`` = ``perm_epoch[t*B:(t+1)*B]`` computed here from the sampler's documented contract.
  Equal values mean the run continued at the next unseen global batch, with no batch repeated or skipped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from paratrain.testing import free_port
from tests.conftest import cli_env, last_json

pytestmark = pytest.mark.e2e

STEPS, EVERY, BATCH, KILL_AFTER = 600, 50, 64, 100


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def _kill_node(agent: subprocess.Popen[str]) -> None:
    """SIGKILL a whole 'node': the agent's process group and its workers (torch starts every worker in a
    session of its own, so killing the agent's group alone would leave its worker training, orphaned)."""
    victims = _children(agent.pid)
    try:
        os.killpg(agent.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _plain_continuation(step_dir: Path, cfg_json: str, start: int) -> tuple[list[float], Any]:
    """Single-process reference from ``step_dir``: plain torch loop, not paratrain's trainer or manager."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from paratrain.config import RunConfig
    from paratrain.data import build_dataset
    from paratrain.models import build_model

    cfg = RunConfig.from_json(cfg_json)
    data = build_dataset(cfg.data)
    model = build_model(cfg.model, data.input_shape, data.num_outputs)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
    flat = StateDictOptions(
        flatten_optimizer_state_dict=True
    )  # checkpoint format 2: flattened optimizer state
    msd, osd = get_state_dict(model, opt, options=flat)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=flat)
    n = len(data.train)
    per_epoch = n // BATCH
    losses = []
    for t in range(start, STEPS):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.train.seed + t // per_epoch))
        idx = perm[(t % per_epoch) * BATCH : (t % per_epoch + 1) * BATCH]
        loss = torch.nn.functional.cross_entropy(model(data.train.x[idx]).float(), data.train.y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.timeout(150)
def test_node_loss_rerendezvous_at_world_size_one_and_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    port = free_port()
    common = [
        sys.executable,
        "-m",
        "paratrain",
        "train",
        "--model",
        "mlp",
        "--data",
        "digits",
        "--steps",
        str(STEPS),
        "--batch-size",
        str(BATCH),
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "e2e-elastic",
        "--max-restarts",
        "2",
        "--ckpt-every",
        str(EVERY),
        "--run-dir",
        str(run),
        "--timeout",
        "30",
        "--json",
        # a dead node leaves the rendezvous 3 s after its last heartbeat; the survivor then waits 8 s for
        # more nodes (the first round completes as soon as both agents have joined: max nodes reached)
        "--rdzv-conf",
        "last_call_timeout=8,keep_alive_interval=1,keep_alive_max_attempt=3",
    ]
    # node rank 0 hosts the c10d rendezvous store on the endpoint: it is the node that must survive
    agents = [
        subprocess.Popen(
            [*common, "--node-rank", str(r)],
            cwd=tmp_path,
            env=cli_env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for r in (0, 1)
    ]
    try:
        marker = (
            run / "checkpoints" / f"step_{KILL_AFTER:08d}"
        )  # committed (renamed) => mid-run, world size 2
        deadline = time.monotonic() + 90
        while not marker.is_dir():
            assert time.monotonic() < deadline, "no checkpoint within 90 s"
            assert all(a.poll() is None for a in agents), [a.communicate() for a in agents]
            time.sleep(0.05)
        _kill_node(agents[1])
        out, err = agents[0].communicate(timeout=100)
    finally:
        for a in agents:
            _kill_node(a)
    assert agents[0].returncode == 0, err
    got = last_json(out)
    assert re.search(r"rank [01] stopped responding", err), err  # the survivor named the dead peer
    resumed = got["resumed_from_step"]
    assert got["restarts"] >= 1 and got["world_size"] == 1 and got["steps"] == STEPS, err
    assert resumed is not None and resumed % EVERY == 0 and KILL_AFTER <= resumed < STEPS
    step_dir = run / "checkpoints" / f"step_{resumed:08d}"
    saved = json.loads((step_dir / "train_state.json").read_text())
    sampler = saved["sampler"]  # its position in global batches: epoch * batches_per_epoch + step
    assert saved["world_size"] == 2
    assert sampler["epoch"] * (sampler["num_samples"] // BATCH) + sampler["step"] == resumed
    assert len(got["losses"]) == STEPS and got["losses"][:resumed] == saved["losses"]
    assert all(v == v and abs(v) < 1e3 for v in got["losses"])  # finite

    import torch

    from paratrain.train.trainer import param_digest

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker (OMP_NUM_THREADS=1): the same reduction order in every kernel
    try:
        ref_losses, ref_model = _plain_continuation(step_dir, (run / "config.json").read_text(), resumed)
    finally:
        torch.set_num_threads(threads)
    # Bitwise: one process each, the same kernels, the same batches in the same order.
    assert got["losses"][resumed:] == ref_losses
    assert got["param_sha256"] == param_digest(dict(ref_model.named_parameters()))[0]


@pytest.mark.timeout(60)
def test_bad_rdzv_conf_fails_before_start(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    proc = run_cli(
        "train",
        "--model",
        "mlp",
        "--data",
        "digits",
        "--steps",
        "1",
        "--rdzv-conf",
        "last_call_timeout=5,keepalive=1",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--rdzv-conf 'keepalive=1'" in proc.stderr and "keep_alive_interval" in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing started, no run directory


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_killed_on_one_of_two_nodes_restarts_both_and_resumes(tmp_path: Path) -> None:
    """Rank 3 SIGKILLs itself on one of two agents: that agent counts a restart, the other restarts for the
    membership change without counting one (torch's restart count is per agent). The restarted workers
    must still find each other (one store prefix per round on every node, not per agent's count), resume
    from the last checkpoint and finish. Several runs, since which agent restarts first is a race."""
    for attempt in range(3):
        port, run = free_port(), tmp_path / f"run{attempt}"

        def agent(
            node: int, port: int = port, attempt: int = attempt, run: Path = run
        ) -> subprocess.Popen[str]:
            return subprocess.Popen(
                [
                    sys.executable, "-m", "paratrain", "train", "--nnodes", "2", "--node-rank", str(node),
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"e2e-kill-{attempt}",
                    "--nproc-per-node", "2", "--strategy", "dp", "--steps", "8", "--ckpt-every", "2",
                    "--max-restarts", "1", "--fail-at-step", "5", "--fail-rank", "3", "--timeout", "45",
                    "--run-dir", str(run), "--json",
                ],
                cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip

        procs = [agent(0), agent(1)]
        outs = [p.communicate(timeout=140) for p in procs]
        for p, (_out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, (attempt, err[-3000:])
        summary = last_json(outs[0][0])
        assert summary["steps"] == 8 and summary["world_size"] == 4
        assert "fault injection: rank 3 kills itself" in outs[0][1] + outs[1][1]
        assert "resumed from" in outs[0][1] + outs[1][1]
