"""The trace analysis of ``--profile`` on synthetic Chrome-trace events: intervals, compute/communication
split, exposed against overlapped, the GPU timeline, and the cross-rank table."""

from __future__ import annotations

from typing import Any

import pytest

from paratrain.train.profile_summary import (
    format_table,
    intersect,
    is_communication,
    subtract,
    summarize_rank,
    summarize_ranks,
    total,
    union,
)

MAIN, GLOO = 100, 200


def ev(name: str, ts: float, dur: float, tid: int = MAIN, cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "cat": cat}


def step(n: int, ts: float, dur: float) -> dict[str, Any]:
    return ev(f"ProfilerStep#{n}", ts, dur, cat="user_annotation")


def test_interval_arithmetic() -> None:
    a = union([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)])
    assert a == [(0, 3), (5, 8)] and total(a) == 6
    b = union([(2, 6)])
    assert intersect(a, b) == [(2, 3), (5, 6)]
    assert subtract(a, b) == [(0, 2), (6, 8)]
    assert subtract(b, a) == [(3, 5)]
    assert subtract(a, []) == a and intersect(a, []) == []
    assert subtract([(0, 10)], [(1, 2), (3, 4), (9, 12)]) == [(0, 1), (2, 3), (4, 9)]


@pytest.mark.parametrize(
    ("name", "comm"),
    [
        ("c10d::allreduce_", True),
        ("gloo:all_reduce", True),
        ("nccl:all_gather", True),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", True),
        ("c10d::send", True),
        ("FSDP::all_gather", True),
        ("record_param_comms", True),
        ("aten::broadcast_tensors", False),  # arithmetic, not a transfer
        ("aten::addmm", False),
        ("autograd::engine::evaluate_function: AddmmBackward0", False),
    ],
)
def test_is_communication(name: str, comm: bool) -> None:
    assert is_communication(name) is comm


def _cpu_trace() -> list[dict[str, Any]]:
    """Two 100 us steps. Step 1: compute 0-40 on the main thread, an all-reduce on Gloo's thread 20-60
    (20 us under compute, 20 exposed). Step 2: compute 100-130, an all-reduce 130-170 with no compute
    (all exposed); the main thread's enqueue op (c10d::allreduce_, 128-131) sits inside a compute op."""
    return [
        step(1, 0, 100),
        step(2, 100, 100),
        ev("paratrain.data", 0, 5, cat="user_annotation"),
        ev("paratrain.data", 100, 5, cat="user_annotation"),
        ev("paratrain.optimizer", 80, 10, cat="user_annotation"),
        ev("paratrain.optimizer", 180, 10, cat="user_annotation"),
        ev("aten::addmm", 0, 40),
        ev("aten::mm", 10, 10),  # nested: the union counts it once
        ev("gloo:all_reduce", 20, 40, tid=GLOO, cat="user_annotation"),
        ev("autograd::engine::evaluate_function: AccumulateGrad", 100, 31),
        ev("c10d::allreduce_", 128, 3),  # inside the op above: communication, not compute
        ev("gloo:all_reduce", 130, 40, tid=GLOO, cat="user_annotation"),
        ev("aten::addmm", 250, 30),  # outside every step: ignored
    ]


def test_cpu_split_exposed_and_overlapped() -> None:
    s = summarize_rank(_cpu_trace(), world_size=2)
    assert s["steps"] == 2 and s["timeline"] == "cpu"
    assert s["step_ms"] == pytest.approx(0.100)
    # compute: 0-40 and 100-128 (the enqueue 128-131 is communication): 68 us over 2 steps
    assert s["compute_ms"] == pytest.approx(0.034)
    # communication: 20-60 and 128-170: 82 us; overlapped 20-40: 20 us; exposed 62 us
    assert s["comm_ms"] == pytest.approx(0.041)
    assert s["comm_overlapped_ms"] == pytest.approx(0.010)
    assert s["comm_exposed_ms"] == pytest.approx(0.031)
    assert s["comm_exposed_ms"] + s["comm_overlapped_ms"] == pytest.approx(s["comm_ms"])
    assert s["data_ms"] == pytest.approx(0.005) and s["optimizer_ms"] == pytest.approx(0.010)
    # other = step - compute - exposed = (200 - 68 - 62) / 2 us
    assert s["other_ms"] == pytest.approx(0.035)


def test_world_size_one_has_no_communication() -> None:
    s = summarize_rank({"traceEvents": _cpu_trace(), "distributedInfo": {"world_size": 1}})
    assert s["comm_ms"] == 0 and s["comm_exposed_ms"] == 0 and s["comm_overlapped_ms"] == 0
    assert s["compute_ms"] == pytest.approx(0.034)  # the collectives' time is not compute either


def test_steps_filter_drops_a_partial_last_step() -> None:
    trace = [*_cpu_trace(), step(3, 200, 500)]
    assert summarize_rank(trace, 2)["steps"] == 3
    s = summarize_rank(trace, 2, steps=(1, 2))
    assert s["steps"] == 2 and s["step_ms"] == pytest.approx(0.100)


def test_gpu_timeline_uses_kernels() -> None:
    trace = [
        step(1, 0, 50),
        ev("aten::mm", 0, 5),  # host ops are not the device's time
        ev("nccl:all_reduce", 5, 2),
        ev("sm80_gemm", 10, 30, tid=7, cat="kernel"),
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 30, 30, tid=8, cat="kernel"),
        ev("paratrain.optimizer", 40, 1, cat="user_annotation"),
        ev("paratrain.optimizer", 60, 8, cat="gpu_user_annotation"),
    ]
    s = summarize_rank(trace, world_size=2)
    assert s["timeline"] == "gpu"
    assert s["compute_ms"] == pytest.approx(0.030)
    assert s["comm_ms"] == pytest.approx(0.030)
    assert s["comm_overlapped_ms"] == pytest.approx(0.010)  # 30-40 under the gemm on another stream
    assert s["comm_exposed_ms"] == pytest.approx(0.020)
    assert s["optimizer_ms"] == pytest.approx(0.008)  # the device span of the label


def test_empty_trace() -> None:
    s = summarize_rank([], world_size=2)
    assert s["steps"] == 0 and s["step_ms"] is None and s["comm_ms"] == 0


def test_cross_rank_slowest_and_gap() -> None:
    ranks = [{"rank": r, **summarize_rank(_cpu_trace(), 2)} for r in range(3)]
    ranks[2]["step_ms"] = 0.150
    out = summarize_ranks(ranks)
    assert out["slowest_rank"] == 2
    assert out["median_step_ms"] == pytest.approx(0.100)
    assert out["slowest_gap_ms"] == pytest.approx(0.050)
    assert out["slowest_gap_pct"] == pytest.approx(50.0)
    table = format_table({**out, "profiled_steps": [1, 2], "timeline": "cpu"})
    assert "slowest rank: 2" in table and "+50.0%" in table
    assert len([ln for ln in table.splitlines() if ln.strip()[:1].isdigit()]) == 3  # one row per rank
