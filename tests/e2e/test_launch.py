"""The launcher as a user runs it: torchrun drop-in on loopback, and two agents forming one multi-node job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paratrain.testing import free_port
from tests.conftest import cli_env, last_json, run_cli

pytestmark = pytest.mark.e2e

SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
listening = []
if dist.get_rank() == 0:
    # every listening TCP socket of this machine on the job's rendezvous port (and its host's)
    port = int(os.environ["MASTER_PORT"])
    for line in open("/proc/net/tcp").read().splitlines()[1:] + open("/proc/net/tcp6").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            listening.append(local.rsplit(":", 1)[0])
# one write per line: two ranks share the terminal, and print() writes the text and the newline separately
sys.stdout.write(json.dumps({"rank": dist.get_rank(), "sum": t.item(), "args": sys.argv[1:],
                             "master": os.environ["MASTER_ADDR"], "listening": listening}) + "\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


@pytest.mark.timeout(90)
def test_launch_dropin_runs_script_on_loopback_only(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = run_cli("launch", "--nproc-per-node", "2", str(script), "--lr", "0.1", cwd=tmp_path, timeout=80)
    import json

    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert sorted(r["rank"] for r in lines) == [0, 1]
    assert all(r["sum"] == 3.0 and r["args"] == ["--lr", "0.1"] and r["master"] == "127.0.0.1" for r in lines)
    rank0 = next(r for r in lines if r["rank"] == 0)
    # the workers' c10d store listens on 127.0.0.1 only (0100007F), never on 0.0.0.0 or ::
    assert rank0["listening"] == ["0100007F"], rank0["listening"]


def _train_in_process(cfg_json: str, run_dir: str) -> dict[str, Any]:
    """``paratrain train``'s worker run in-process on this rank (no launcher): its summary."""
    from paratrain.config import RunConfig
    from paratrain.runtime import init
    from paratrain.train.worker import train

    cfg = RunConfig.from_json(cfg_json)
    return train(cfg, init("gloo", "cpu", 60.0, cfg.train.seed), Path(run_dir)).summary()


@pytest.mark.timeout(240)
def test_two_agents_form_one_multinode_job_over_loopback(tmp_path: Path, dist_run: Any) -> None:
    port = free_port()
    job = ["--model", "mlp", "--data", "synthetic-classification", "--steps", "4", "--batch-size", "32",
           "--json"]  # fmt: skip
    common = [
        "train",
        *job,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "e2e-two-agents",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "paratrain", *common, "--node-rank", str(r)],
            cwd=tmp_path,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=140) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    summaries = [last_json(out) for out, _ in outs if out.strip()]
    assert summaries, [err for _, err in outs]
    s = summaries[0]
    assert s["world_size"] == 2 and s["steps"] == 4 and s["param_sha256"]
    # the same job on 2 local ranks (the worker's training run in-process on each, no launcher): the two
    # agents trained exactly the same model
    from paratrain.cli import build_config, make_parser

    local_dir = str(tmp_path / "local")
    argv = ["train", *job, "--nproc-per-node", "2", "--run-dir", local_dir]
    cfg_json = build_config(make_parser().parse_args(argv)).to_json()
    local = dist_run(_train_in_process, 2, cfg_json, local_dir)[0]
    assert local["world_size"] == 2 and local["losses"] == s["losses"]
    assert local["param_sha256"] == s["param_sha256"]


AFFINITY = """
import json, os, sys
threads = None
if sys.argv[1] == "torch":  # torch's thread count; the other runs skip its import (seconds per rank)
    import torch
    threads = torch.get_num_threads()
sys.stdout.write(json.dumps({"rank": int(os.environ["LOCAL_RANK"]), "cores": sorted(os.sched_getaffinity(0)),
                             "omp": os.environ.get("OMP_NUM_THREADS"), "threads": threads,
                             "main": __name__ == "__main__", "argv": sys.argv[1:],
                             "blocks_env": os.environ.get("PARATRAIN_CPU_BLOCKS")}) + "\\n")
sys.stdout.flush()
"""


def _affinity_run(tmp_path: Path, nproc: int, cores: list[int], *flags: str, arg: str = "x") -> list[dict]:
    """``paratrain launch`` started on ``cores`` only (as under taskset or a Slurm cpuset), with no
    OMP_NUM_THREADS of its own; each rank's view of itself, by local rank (``arg`` "torch": with torch's
    thread count)."""
    import json
    import os

    script = tmp_path / "affinity.py"
    script.write_text(AFFINITY)
    env = {k: v for k, v in cli_env().items() if k != "OMP_NUM_THREADS"}
    env["PARATRAIN_CPU_BLOCKS"] = "0;0;0"  # left over from an outer launch: must not leak into this one
    proc = subprocess.run(
        [sys.executable, "-m", "paratrain", "launch", "--nproc-per-node", str(nproc), *flags, str(script), arg],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = sorted(
        (json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")), key=lambda r: r["rank"]
    )
    assert [r["rank"] for r in rows] == list(range(nproc)), proc.stdout
    assert all(r["main"] and r["argv"] == [arg] for r in rows)  # the script runs as itself
    return rows


@pytest.mark.timeout(240)
@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_cpu_bind_pins_each_worker_to_its_block_of_the_launchers_cores(tmp_path: Path) -> None:
    import os

    mine = sorted(os.sched_getaffinity(0))
    # two ranks on all of this process's cores: one half each when there are two or more
    rows = _affinity_run(tmp_path, 2, mine, "--cpu-bind", "cores", arg="torch")
    if len(mine) >= 2:
        half = len(mine) // 2
        assert [r["cores"] for r in rows] == [mine[:half], mine[half : 2 * half]]
        assert all(r["omp"] == str(half) and r["threads"] == half for r in rows)
    else:
        assert [r["cores"] for r in rows] == [mine, mine]
    # the launcher confined to its last core: every rank stays there (the launcher's affinity holds)
    rows = _affinity_run(tmp_path, 3, mine[-1:], "--cpu-bind", "cores")
    assert [r["cores"] for r in rows] == [mine[-1:]] * 3
    assert all(r["omp"] == "1" for r in rows)  # torch follows OMP_NUM_THREADS (the first run checks it)
    # without it the workers inherit the launcher's cores, and the outer launch's blocks do not leak in
    rows = _affinity_run(tmp_path, 2, mine)
    assert all(r["cores"] == mine and r["blocks_env"] is None for r in rows)
    assert all(r["omp"] == str(max(1, len(mine) // 2)) for r in rows)
