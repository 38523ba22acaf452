"""benchmarks/bench_p2p_dispatch.py runs as documented; benchmarks/profile_ring.py reads perf's report."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_p2p_dispatch_smoke_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "p2p.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_p2p_dispatch.py"), "--ranks", "2", "--runs", "1",
           "--reps", "2", "--inner", "20", "--json", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=140, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == doc
    (run,) = doc["runs"]
    res = run["results"]
    assert res["ranks"] == 2
    cases = {k for k in res if k != "ranks"}
    assert cases == {"pingpong 4 B", "pingpong 64 KiB", "tree all_reduce 4 B", "ring all_reduce 16 MB"}
    for case in cases:
        row = res[case]
        assert row["group"]["time_us"] > 0 and row["backend"]["time_us"] > 0
        assert row["group_over_backend"] == pytest.approx(row["group"]["time_us"] / row["backend"]["time_us"])


def test_profile_ring_groups_perf_report_lines() -> None:
    prof = _module("profile_ring")
    lines = {
        "    15.48%          3420  [kernel.kallsyms]   [k] _copy_to_iter": "kernel: socket receive copy",
        "    14.80%          3270  [kernel.kallsyms]   [k] _copy_from_iter": "kernel: socket send copy",
        "    11.50%          2541  [kernel.kallsyms]   [k] pv_native_safe_halt": "kernel: idle",
        "     5.77%          1275  [kernel.kallsyms]   [k] _raw_spin_unlock_irqrestore": "kernel: other",
        "     4.70%          1023  libtorch_cpu.so     [.] gloo::sum<float>": "reduction",
        "     4.45%           984  libtorch_cpu.so     [.] c10::function_ref<void (char**, long const*, long, long)>"
        "::callback_fn<at::native::AVX2::VectorizedLoop2d<at::native::(anonymous namespace)::add_kernel(at::"
        "TensorIteratorBase&, c10::Scalar const&)::{lambda()#1}>": "reduction",
        "     1.63%           360  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault": "python",
        "     0.36%            75  libtorch_python.so  [.] pybind11::cpp_function::dispatcher": "pybind/c10d",
        "     0.30%            60  libc.so.6           [.] malloc": "user: other",
    }
    for line, category in lines.items():
        m = prof.LINE.match(line)
        assert m is not None, line
        assert prof._category(m.group(3), m.group(4), m.group(5)) == category, line
    assert prof.LINE.match("# Samples: 19K of event 'cpu-clock:ppp'") is None


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_ring_variants_are_exact_and_write_json(tmp_path: Path) -> None:
    # 3 ranks and 10,001 floats: chunks of uneven length
    out = tmp_path / "variants.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_ring_variants.py"), "--ranks", "3", "--bytes",
           "40004", "--runs", "1", "--iters", "2", "--warmup", "0", "--json", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=140, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == doc
    assert doc["ranks"] == 3 and doc["bytes"] == 40004
    (run,) = doc["runs"]
    variants = run["variants"]
    assert set(variants) == {"native", "ring", "ring-slot-sums", "ring-slot-sums-kept", "ring-bidir"}
    for name, row in variants.items():
        assert row["exact"] is True, name  # each all-reduce equals Gloo's before it is timed
        assert row["time_s"] > 0 and row["cpu_s_all_ranks"] > 0
    assert variants["native"]["vs_native"] == 1.0
    bad = subprocess.run([*cmd[:2], "--variants", "ring,nope"], capture_output=True, text=True, timeout=60,
                         check=False)  # fmt: skip
    assert bad.returncode != 0 and "nope" in bad.stderr
