"""The README's Python API example runs under `paratrain launch` and learns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_quickstart_example_under_launch(tmp_path: Path) -> None:
    proc = run_cli("launch", "--nproc-per-node", "2", str(REPO / "examples" / "quickstart.py"), cwd=tmp_path)
    m = re.search(r"world size 2: final loss ([0-9.]+), train accuracy ([0-9.]+)%", proc.stdout)
    assert m, proc.stdout + proc.stderr
    assert float(m.group(2)) > 90.0
    assert proc.stdout.count("world size") == 1  # printed on rank 0 only
