"""``paratrain lint FILE`` runs with torch unimportable, and one file costs well under a second of CPU.

The probe runs in a fresh interpreter with ``sys.modules["torch"] = None`` (so ``import torch`` raises
ImportError, as if torch were not installed) and calls the real CLI entry point, ``paratrain.cli.main``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import json, resource, sys
    sys.modules["torch"] = None  # any `import torch` now raises ImportError
    from paratrain.cli import main
    code = main(sys.argv[1:])
    used = resource.getrusage(resource.RUSAGE_SELF)
    heavy = sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] in ("torch", "numpy"))
    print(json.dumps({"code": code, "cpu_s": used.ru_utime + used.ru_stime, "heavy": heavy}), file=sys.stderr)
    """
)

SCRIPT = """\
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("nccl")
model = nn.DataParallel(nn.Linear(4, 4))
dist.destroy_process_group()
"""


def _probe(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=120
    )
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "{}"
    return done, json.loads(last)


@pytest.mark.timeout(120)
def test_paratrain_lint_runs_with_torch_unimportable(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done, seen = _probe("lint", "--json", str(script))
    assert seen["code"] == 1, done.stderr
    report = json.loads(done.stdout)
    assert [f["rule"] for f in report["findings"]] == ["data-parallel"]
    assert seen["heavy"] == [], f"lint imported {seen['heavy']}"
    # CPU time of the whole process (interpreter start-up included), not wall time: importing torch alone
    # costs several seconds of CPU, the checker a few tenths at most, so 1 s separates them under any load.
    assert isinstance(seen["cpu_s"], float) and seen["cpu_s"] < 1.0, seen


@pytest.mark.timeout(120)
def test_paratrain_lint_usage_errors_with_torch_unimportable(tmp_path: Path) -> None:
    done, seen = _probe("lint", str(tmp_path / "missing.py"))
    assert seen["code"] == 2 and "no such file or directory" in done.stderr
    done, seen = _probe("lint", "--list-rules")
    assert seen["code"] == 0 and "data-parallel" in done.stdout and seen["heavy"] == []
