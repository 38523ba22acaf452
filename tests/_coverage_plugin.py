"""A pytest plugin for ``tests/test_strategy_coverage.py``: after collection (and ``-m`` deselection), write
the strategy names that the selected tests declare with ``@pytest.mark.equivalence(...)`` to the JSON file
named by ``PARATRAIN_COVERAGE_OUT``, as ``{test id: [strategy, ...]}``."""

from __future__ import annotations

import json
import os

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    out = os.environ.get("PARATRAIN_COVERAGE_OUT")
    if not out:
        return
    covered: dict[str, list[str]] = {}
    for item in session.items:
        names = [str(n) for mark in item.iter_markers("equivalence") for n in mark.args]
        if names:
            covered[item.nodeid] = sorted(set(names))
    with open(out, "w") as f:
        json.dump(covered, f, indent=1, sort_keys=True)
