"""Every registered strategy has an equivalence test in the default tier (what ``make test`` and CI run).

Equivalence tests declare what they hold to the single-process reference with
``@pytest.mark.equivalence(*strategy_names)``, computed from the cases they run. This test reads the
default tier (``-m "not slow"``) of tests/dist and tests/e2e and checks that the union of those declarations
covers ``paratrain.parallel.available_strategies(include_aliases=False)``: a new strategy, or an equivalence
test moved to ``slow``, fails here until a default-tier test holds it to the reference.

Where the running session is itself the whole default tier (``make test``: ``pytest -m "not slow"`` over
``tests/``, no ``-k`` or ``--deselect``), its own collected items are that tier and are read directly;
otherwise (this file alone, a ``-k`` selection) the tier is collected in a subprocess.
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


def _declarations_of_this_session(request: pytest.FixtureRequest) -> dict[str, list[str]] | None:
    """The equivalence declarations of the default tier when this session collected exactly that tier (every
    test of tests/dist and tests/e2e not marked slow); None otherwise."""
    config = request.config
    option = config.option
    if (option.markexpr or "").strip() != "not slow" or option.keyword or getattr(option, "deselect", None):
        return None
    if getattr(option, "lf", False):
        return None
    tests = (REPO / "tests").resolve()
    given = [Path(str(a).split("::")[0]).resolve() for a in config.args] or [tests]
    if not all(p in (tests, REPO.resolve()) for p in given):
        return None
    dirs = (tests / "dist", tests / "e2e")
    declared: dict[str, list[str]] = {}
    for item in request.session.items:
        if not any(Path(str(item.path)).resolve().is_relative_to(d) for d in dirs):
            continue
        names = [str(n) for mark in item.iter_markers("equivalence") for n in mark.args]
        if names:
            declared[item.nodeid] = sorted(set(names))
    return declared


def test_every_registered_strategy_has_a_default_tier_equivalence_test(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from paratrain.parallel import available_strategies

    declared = _declarations_of_this_session(request)
    if declared is None:
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
