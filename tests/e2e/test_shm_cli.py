"""The shared-memory transport as a user runs it: a killed rank in a ``dp`` + ``shm`` training run, the
hierarchical all-reduce across two agents on loopback acting as two nodes, and ``paratrain train`` with
``--comm-algorithm shm`` on those two nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from paratrain.testing import free_port
from tests.conftest import cli_env

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(150)
def test_killed_rank_in_dp_shm_run_fails_the_others_naming_it_and_leaves_no_segment(tmp_path: Path) -> None:
    job = f"shmkill{uuid.uuid4().hex[:8]}"  # part of every segment name of this run
    env = {**cli_env(), "PARATRAIN_JOB_ID": job}
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable, "-m", "paratrain", "train", "--model", "mlp", "--data", "synthetic-classification",
            "--steps", "20", "--batch-size", "32", "--strategy", "dp", "--comm-algorithm", "shm",
            "--nproc-per-node", "2", "--fail-at-step", "2", "--fail-rank", "1",
            "--run-dir", str(tmp_path / "run"), "--json",
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stderr
    assert "rank 1 kills itself (SIGKILL) at step 2" in proc.stderr
    # the survivor's shm wait noticed the dead peer (liveness check, not the timeout) and named it
    assert "rank 1 (pid" in proc.stderr and "died while the others waited" in proc.stderr, proc.stderr
    # the killed rank is the launcher's headline, not the survivor that noticed it (as with the native backend)
    assert "paratrain train: rank 1 died (killed by signal SIGKILL)" in proc.stderr, proc.stderr
    assert "rank 0 then failed: RuntimeError: shm " in proc.stderr and "stopped after it" not in proc.stderr
    assert elapsed < 120
    assert [n for n in os.listdir("/dev/shm") if job in n] == []


HIER_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
from paratrain.comm import shm
dist.init_process_group("gloo")
rank, local = dist.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"])
intra, inter = shm.make_hierarchical_groups()
groups = [dist.get_process_group_ranks(intra), dist.get_process_group_ranks(inter)]
shm.get_communicator(intra, capacity_bytes=1024, small_bytes=0)  # tiny slots: many pieces per call
NATIVE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
          "prod": dist.ReduceOp.PRODUCT}
bad, count = [], 0
for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32):
    for op in ("sum", "max", "min", "prod"):
        for shape in ((), (0,), (3,), (5, 7), (1001,)):
            g = torch.Generator().manual_seed(10 * count + rank)
            x = torch.randint(-2 if op == "prod" else -6, 3 if op == "prod" else 7, shape, generator=g).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref, op=NATIVE[op])
            got = shm.hierarchical_all_reduce(x.clone(), op, intra, inter)
            count += 1
            if not torch.equal(got, ref):
                bad.append(f"{dtype} {op} {shape}")
x = torch.randn(70_001, generator=torch.Generator().manual_seed(rank))
ref = x.clone()
dist.all_reduce(ref)
got = shm.hierarchical_all_reduce(x.clone(), "mean", intra, inter)
count += 1
if not torch.allclose(got, ref / dist.get_world_size(), rtol=1e-5, atol=1e-6):
    bad.append("random mean")
sys.stdout.write(json.dumps({"rank": rank, "node": int(os.environ["GROUP_RANK"]), "local": local,
                             "groups": groups, "bad": bad, "count": count}) + "\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hierarchical_all_reduce_across_two_agents_on_loopback(tmp_path: Path) -> None:
    script = tmp_path / "hier.py"
    script.write_text(HIER_SCRIPT)
    port = free_port()

    def agent(node: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable, "-m", "paratrain", "launch", "--nnodes", "2", "--node-rank", str(node),
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "e2e-shm-hier", "--nproc-per-node", "2",
                str(script),
            ],
            cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    procs = [agent(0), agent(1)]
    outs = [p.communicate(timeout=170) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    lines = [json.loads(ln) for out, _ in outs for ln in out.splitlines() if ln.startswith("{")]
    assert sorted(r["rank"] for r in lines) == [0, 1, 2, 3]
    for r in lines:
        assert r["node"] == r["rank"] // 2 and r["local"] == 2  # ranks numbered node by node
        base = r["rank"] - r["rank"] % 2
        assert r["groups"] == [[base, base + 1], [r["rank"] % 2, r["rank"] % 2 + 2]]
        assert r["bad"] == [] and r["count"] == 101


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "dp"])
def test_shm_training_on_two_agents_runs_the_hierarchical_all_reduce(tmp_path: Path, strategy: str) -> None:
    """``paratrain train --nnodes 2 ... --comm-algorithm shm`` as a user runs it on two nodes (two agents on
    loopback, one shared run directory): shm inside each node, Gloo between; the losses match the same run
    with the backend's own all-reduce."""
    port = free_port()
    common = ["--steps", "6", "--batch-size", "32", "--strategy", strategy, "--json"]

    def agent(node: int, run_dir: str, algorithm: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable, "-m", "paratrain", "train", "--nnodes", "2", "--node-rank", str(node),
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"e2e-{run_dir}", "--nproc-per-node", "2",
                *common, "--comm-algorithm", algorithm, "--run-dir", run_dir,
            ],
            cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    summaries = {}
    for algorithm in ("shm", "native"):
        procs = [agent(0, f"run-{algorithm}", algorithm), agent(1, f"run-{algorithm}", algorithm)]
        outs = [p.communicate(timeout=140) for p in procs]
        for p, (_out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err
        summaries[algorithm] = json.loads([ln for ln in outs[0][0].splitlines() if ln.startswith("{")][-1])
        if algorithm == "shm":
            assert (
                f"{strategy} --comm-algorithm shm: hierarchical all-reduce over 2 nodes of 2 ranks"
                in outs[0][1]
            )
    shm, native = summaries["shm"], summaries["native"]
    assert shm["world_size"] == native["world_size"] == 4 and len(shm["losses"]) == 6
    assert shm["losses"] == pytest.approx(native["losses"], rel=1e-5, abs=1e-6)
    assert [n for n in os.listdir("/dev/shm") if n.startswith("paratrain-shm")] == []
