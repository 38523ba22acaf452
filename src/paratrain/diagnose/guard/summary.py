"""The closing line of a guarded run that found nothing: what the guard checked, so that a clean guarded
run does not look like an unguarded one.

    paratrain guard: checked 2 of 2 ranks: 8 collectives recorded (4 on rank 0), 0 mismatches, no hang;
    6 desync checks (replicas equal); 0 warnings

Pure functions over the ranks' records (:class:`~paratrain.diagnose.guard.record.RankView`); the launcher
prints the line (or, with ``--json``, the object) once the job has ended.
"""

from __future__ import annotations

import json

from paratrain.diagnose.guard.record import RankView


def summarize(views: dict[int, RankView]) -> dict[str, int]:
    """``{"ranks", "world", "collectives", "collectives_rank0", "desync_checks", "warnings", "steps"}``.

    ``collectives`` sums every rank's recorded collectives; ``desync_checks`` is the most any rank made
    (every rank takes part in each); ``warnings`` sums the warnings printed (each is printed by one rank).
    """
    first = views.get(0) or next(iter(views.values()), None)
    return {
        "ranks": len(views),
        "world": max((v.world for v in views.values()), default=0),
        "collectives": sum(v.total for v in views.values()),
        "collectives_rank0": views[0].total if 0 in views else 0,
        "desync_checks": max((v.desync_checks for v in views.values()), default=0),
        "warnings": sum(v.warnings for v in views.values()),
        "steps": first.step if first is not None else 0,
    }


def summary_line(s: dict[str, int]) -> str:
    """The one human-readable line (without a trailing newline)."""
    checks = s["desync_checks"]
    desync = (
        f"{checks} desync check{'s' if checks != 1 else ''} (replicas equal)"
        if checks
        else ("no desync check (fewer optimizer steps than --check-desync-every)")
    )
    warnings = s["warnings"]
    return (
        f"paratrain guard: checked {s['ranks']} of {s['world']} ranks: {s['collectives']} collectives recorded "
        f"({s['collectives_rank0']} on rank 0), 0 mismatches, no hang; {desync}; "
        f"{warnings} warning{'s' if warnings != 1 else ''}"
    )


def summary_json(s: dict[str, int]) -> str:
    """``--json``: one object, ``{"guard": {...summarize...}}``."""
    return json.dumps({"guard": {**s, "mismatches": 0, "hangs": 0}})


__all__ = ["summarize", "summary_json", "summary_line"]
