"""From every rank's record to one sentence: which collectives mismatch, who hangs where. Pure functions.

Ranks pair collectives by their order within a process group (torch and the backends do the same: the
N-th collective of a group on one rank meets the N-th on the others). So two things can be read from the
records without any communication:

- a **mismatch**: two ranks' records hold the same ``(group, seq)`` with different signatures (op,
  shapes, dtypes, root). Both are then inside a collective the other side will never complete, or worse,
  one that completes with the wrong data. The running crc ``chain`` also catches a mismatch that scrolled
  out of the ring.
- a **hang**: some rank has waited inside a collective for ``hang_timeout`` seconds and no rank has made
  any progress (a collective, a forward, an optimizer step) in that time. The post-mortem classifies
  every other member of the waited-for group: waiting in it too, never reached it (and where it is now,
  from its sampled stack), waiting in another collective, finished the script, or dead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from paratrain.diagnose.guard.record import EXITED, FAILED, IN_COLLECTIVE, Entry, RankView

LINT_HINT = "a collective reached on some ranks only (paratrain lint: rank-conditional-collective)"


@dataclass
class Finding:
    kind: str
    """``mismatch`` or ``hang`` or ``dead``."""
    message: str
    """First line: the verdict; further lines: one per rank."""


def ranks_text(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 0,2``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ",".join(str(r) for r in ranks)


def _members(group: str, world: int) -> list[int]:
    if not group:
        return list(range(world))
    return [int(r) for r in group.split(",") if r.strip().isdigit()]


def _ago(now: float, t: float) -> str:
    return f"{max(0.0, now - t):.0f}s ago"


def find_mismatch(views: dict[int, RankView]) -> Finding | None:
    """The earliest ``(group, seq)`` at which ranks recorded different signatures, if any."""
    by_key: dict[tuple[int, int], dict[int, Entry]] = {}
    for rank, view in views.items():
        for e in view.entries:
            by_key.setdefault((e.gkey, e.seq), {})[rank] = e
    worst: tuple[float, tuple[int, int], dict[int, Entry], bool] | None = None
    for key, per_rank in by_key.items():
        if len(per_rank) < 2:
            continue
        sigs = {e.sig for e in per_rank.values()}
        chains = {e.chain for e in per_rank.values()}
        if len(sigs) > 1 or len(chains) > 1:
            t = min(e.t_enter for e in per_rank.values())
            if worst is None or t < worst[0]:
                worst = (t, key, per_rank, len(sigs) > 1)
    if worst is None:
        return None
    _, (_gkey, seq), per_rank, here = worst
    group = next(iter(per_rank.values())).group
    on = f" on group [{group}]" if group else ""
    if not here:  # same signature here, different history: the first difference scrolled out of the ring
        return Finding(
            "mismatch",
            f"collectives diverged before #{seq}{on}: the ranks issued different collectives earlier than the "
            f"recorder keeps (last {len(views[next(iter(views))].entries)} per rank); likely cause: {LINT_HINT}",
        )
    groups: dict[tuple[int, str, str], list[int]] = {}
    for rank, e in sorted(per_rank.items()):
        groups.setdefault((e.sig, e.op, e.site), []).append(rank)
    parts = [f"{ranks_text(rs)} {op} at {site}" for (_sig, op, site), rs in groups.items()]
    return Finding(
        "mismatch", f"collective #{seq}{on} mismatch: {', '.join(parts)}\n  likely cause: {LINT_HINT}"
    )


def find_hang(
    views: dict[int, RankView],
    world: int,
    now: float,
    hang_timeout: float,
    alive: Callable[[int], bool] | None = None,
) -> Finding | None:
    """A post-mortem when some rank waits in a collective and nobody progressed for ``hang_timeout``."""
    waiting = {r: v.current for r, v in views.items() if v.state == IN_COLLECTIVE and v.current is not None}
    if not waiting:
        return None
    if now - max(v.t_change for v in views.values()) < hang_timeout:
        return None
    return post_mortem(views, world, now, alive)


def post_mortem(
    views: dict[int, RankView], world: int, now: float, alive: Callable[[int], bool] | None = None
) -> Finding | None:
    """Describe the oldest collective some rank is stuck in, and where every other member of its group is."""
    waiting = {r: v.current for r, v in views.items() if v.state == IN_COLLECTIVE and v.current is not None}
    if not waiting:
        return None
    _, target = min(waiting.items(), key=lambda kv: (kv[1].t_enter, kv[0]))  # type: ignore[union-attr]
    assert target is not None
    key = (target.gkey, target.seq)
    what = f"collective #{target.seq} ({target.describe()})"
    in_it: list[int] = []
    missing: list[int] = []
    details: list[str] = []
    for r in _members(target.group, world):
        v = views.get(r)
        if v is None:
            missing.append(r)
            details.append(f"rank {r}: no record (the guard did not start there)")
            continue
        cur = v.current
        dead = alive is not None and v.state != EXITED and not alive(r)
        if v.state == IN_COLLECTIVE and cur is not None and (cur.gkey, cur.seq) == key:
            in_it.append(r)
            if dead:
                details.append(f"rank {r}: died inside it")
            continue
        last = v.last_in_group(target.gkey)
        lseq = last.seq if last is not None else 0
        if lseq >= target.seq:
            details.append(f"rank {r}: already finished collective #{target.seq} (it is at #{lseq})")
            continue
        missing.append(r)
        was = (
            f"its last collective was #{last.seq} ({last.describe()}), {_ago(now, last.t_exit or last.t_enter)}"
            if last is not None
            else "it issued no collective in this group yet"
        )
        if dead or v.state == FAILED:
            details.append(
                f"rank {r}: {'died' if dead else 'failed with an exception'} before reaching it; {was}"
            )
        elif v.state == EXITED:
            details.append(f"rank {r}: finished the script without reaching it; {was}")
        elif v.state == IN_COLLECTIVE and cur is not None:
            details.append(f"rank {r}: is waiting in collective #{cur.seq} {cur.describe()} instead")
        else:
            at = f"; it is now at {v.where}" if v.where else ""
            details.append(f"rank {r}: never reached it; {was}{at}")
    waited = f"{max(0.0, now - target.t_enter):.0f}s"
    if missing:
        verb = "is" if len(in_it) == 1 else "are"
        head = f"hang: {ranks_text(missing)} never reached {what}; {ranks_text(in_it)} {verb} waiting in it ({waited})"
    else:
        verb = "has" if len(in_it) == 1 else "have"
        head = f"hang: {ranks_text(in_it)} {verb} been waiting in {what} for {waited}"
    lines = [head] + [f"  {d}" for d in details]
    return Finding("hang", "\n".join(lines))


def find_problem(
    views: dict[int, RankView],
    world: int,
    now: float,
    hang_timeout: float,
    alive: Callable[[int], bool] | None = None,
) -> Finding | None:
    """A mismatch (at once), else a hang (after ``hang_timeout`` without progress)."""
    return find_mismatch(views) or find_hang(views, world, now, hang_timeout, alive)


def after_failure(views: dict[int, RankView], world: int, now: float) -> Finding | None:
    """Once the job failed: a mismatch, or where the ranks were when one died inside or outside a collective.

    No liveness here: by now the agent has terminated every worker, so "dead" would say nothing; the
    launcher's failure paragraph names the rank that failed first."""
    found = find_mismatch(views)
    if found is not None:
        return found
    if not any(v.state == IN_COLLECTIVE for v in views.values()):
        return None
    pm = post_mortem(views, world, now, None)
    return Finding("dead", pm.message.replace("hang: ", "when the job failed: ", 1)) if pm else None
