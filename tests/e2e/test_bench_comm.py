"""``paratrain bench comm`` as a user runs it: 2 ranks, two sizes, a few iterations."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from paratrain import comm
from paratrain.bench.comm import COLLECTIVES
from tests.conftest import last_json, run_cli

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(240)
def test_bench_comm_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "busbw.png"
    args = [
        "--nproc-per-node",
        "2",
        "--collectives",
        "all",
        "--sizes",
        "1KB,64KB",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--cpu-bind",
        "cores",
    ]
    proc = run_cli("bench", "comm", *args, "--json", "--plot", str(png), cwd=tmp_path, timeout=220)
    result = last_json(proc.stdout)
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    mine = sorted(os.sched_getaffinity(0))  # rank 0 is pinned to the first half of the launcher's cores
    assert result["cpu_bind"] == "cores" and result["rank0_cores"] == mine[: max(1, len(mine) // 2)]
    rows = {(r["collective"], r["algorithm"], r["bytes"]): r for r in result["results"]}
    expected = {(c, a, s) for c in COLLECTIVES for a in comm.ALGORITHMS[c] for s in (1024, 65536)}
    assert set(rows) == expected
    n = 2
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    for (collective, algorithm, size), r in rows.items():
        assert r["time_s"] > 0 and r["min_s"] <= r["time_s"]
        assert r["algbw_GBps"] == pytest.approx(size / r["time_s"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor.get(collective, 1.0))
        assert (r["model_s"] is None) == (algorithm in ("native", "shm"))  # shm: memory-bound, no α–β model
        assert r.get("shm_path") == ("slots" if algorithm == "shm" else None)  # <= 256 KiB: always the slots
    assert result["model"]["alpha_s"] > 0 and result["model"]["beta_s_per_byte"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(180)
def test_bench_comm_table(tmp_path: Path) -> None:
    args = ["--nproc-per-node", "2", "--algorithms", "tree,naive,native", "--sizes", "4KB", "--iters", "2"]
    out = run_cli("bench", "comm", *args, cwd=tmp_path, timeout=160).stdout
    assert "paratrain bench comm: 2 ranks, gloo on cpu" in out
    assert "all_reduce (busbw = algbw × 2(n-1)/n)" in out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.strip().split()[:1] in (["4KB"], ["tree"], ["naive"], ["native"])
    ]
    assert [r[1] if r[0] == "4KB" else r[0] for r in rows] == [
        "tree",
        "naive",
        "native",
    ]  # in the order asked
    assert rows[-1][-1] == "1.00x"  # native against itself
    # "vs native" is busbw / native's busbw = native's time / this time (same size, same busbw factor):
    # a ratio taken the wrong way round, or against the wrong row, would not match the printed times
    times = {r[1] if r[0] == "4KB" else r[0]: float(r[2] if r[0] == "4KB" else r[1]) for r in rows}
    for r in rows[:-1]:
        alg, ratio = (r[1] if r[0] == "4KB" else r[0]), float(r[-1].rstrip("x"))
        assert ratio == pytest.approx(times["native"] / times[alg], abs=0.006, rel=1e-3), (alg, out)
    assert "fastest algorithm by size:" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sizes", "1XB..2MB"], "--sizes: cannot read '1XB' as a size"),
        (["--collectives", "broadcast", "--algorithms", "ring"], "--algorithms: unknown 'ring'"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
        (["--timeout", "nan"], "--timeout: must be a finite number, got 'nan'"),
        (["--timeout", "inf"], "--timeout: must be a finite number, got 'inf'"),
    ],
)
def test_bench_comm_bad_arguments_fail_before_launching(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    _refused(tmp_path, flags, message)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs CUDA GPUs"),
        (["--device", "cuda"], "no CUDA GPU is visible. Use --device cpu."),
    ],
)
def test_bench_comm_gpu_flags_on_a_cpu_machine_fail_before_launching(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: these flags are valid here")
    stderr = _refused(tmp_path, flags, message)
    assert "--set" not in stderr  # bench comm has no --set: the advice names its own flags


def _refused(tmp_path: Path, flags: list[str], message: str) -> str:
    start = time.monotonic()
    proc = run_cli("bench", "comm", *flags, cwd=tmp_path, timeout=50, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if "error:" in ln]) == 1, proc.stderr  # one message
    assert time.monotonic() - start < 30  # nothing was launched
    return proc.stderr
