"""benchmarks/bench_peers.py reports a runner's time only when it computed what torch DDP computed."""

from __future__ import annotations

import importlib.util
from typing import Any

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("bench_peers", REPO / "benchmarks" / "bench_peers.py")
assert _spec is not None and _spec.loader is not None
bench_peers: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_peers)


def _row(diff: float | None) -> dict[str, Any]:
    return {
        "step_s": [0.1, 0.1],
        "cpu_s": [0.2, 0.2],
        "peak_bytes": 1000,
        "param_rel_diff_vs_torch_ddp": diff,
    }


def test_a_runner_with_other_parameters_is_an_error_not_a_time() -> None:
    result = {
        "world_size": 2,
        "errors": {},
        "rows": {
            "torch-ddp": _row(0.0),
            "same": _row(3e-7),
            "skipped_work": _row(0.4),
            "unknown": _row(None),
        },
    }
    rows = {r["runner"]: r for r in bench_peers.summarize(result, batch=32)}
    assert set(rows) == {"torch-ddp", "same"} and rows["same"]["speedup_vs_torch_ddp"] == 1.0
    assert set(result["errors"]) == {"skipped_work", "unknown"}
    assert "differ from torch DDP's by 0.4" in result["errors"]["skipped_work"]
