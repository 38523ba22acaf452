"""Every registered strategy has an equivalence test in the default tier (what ``make test`` and CI run).

Equivalence tests declare what they hold to the single-process reference with
``@pytest.mark.equivalence(*strategy_names)``, computed from the cases they run. This test collects the
default tier (``-m "not slow"``) in a subprocess and checks that the union of those declarations covers
``paratrain.parallel.available_strategies(include_aliases=False)``: a new strategy, or an equivalence test
moved to ``slow``, fails here until a default-tier test holds it to the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env

pytestmark = pytest.mark.timeout(300)


def _default_tier_declarations(tmp_path: Path) -> dict[str, list[str]]:
    out = tmp_path / "covered.json"
    env = {**cli_env(), "PARATRAIN_COVERAGE_OUT": str(out)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "tests._coverage_plugin", "-m", "not slow", "tests/dist", "tests/e2e"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=290,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_registered_strategy_has_a_default_tier_equivalence_test(tmp_path: Path) -> None:
    from paratrain.parallel import available_strategies

    declared = _default_tier_declarations(tmp_path)
    covered = {name for names in declared.values() for name in names}
    registered = set(available_strategies(include_aliases=False))
    missing = sorted(registered - covered)
    assert not missing, (
        f"strategies with no default-tier equivalence test: {missing}. Add a case for each to an equivalence "
        "test that is not marked slow (tests/dist/test_model_parallel.py, test_zero.py, test_dp.py) and "
        "declare it with @pytest.mark.equivalence(...)."
    )
    unknown = sorted(covered - registered)
    assert not unknown, f"equivalence markers name strategies that are not registered: {unknown}"
