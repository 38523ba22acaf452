"""The parent side of ``paratrain doctor``'s communication self-test: start it, bound it, read it, judge it.

The job (:mod:`paratrain.diagnose.doctor_worker`) runs in a child process in its own session: the torch
elastic agent, which starts one process per rank, each in a session of its own. The doctor waits for the
agent until the deadline; past it, it kills every process of the job (the agent's descendants, found in
``/proc`` while the tree is intact, and the ranks by the pids in their reports) and reports which ranks never
finished and in which phase they were. Every rank also stops itself a few seconds before the deadline, so
the kill is the last resort, for a process that cannot even run its watchdog thread.

Nothing here imports torch: the results come back as JSON files in a temporary directory.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paratrain.diagnose.doctor_net import Check

COLLECTIVES = (
    "all_reduce_sum",
    "all_reduce_max",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "barrier",
    "send_recv_ring",
)
_JOB_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
PHASES = {
    "start": "start-up (before init_process_group)",
    "init": "init_process_group",
    "collectives": "the collectives",
    "busbw": "the all_reduce timing",
    "p2p": "the ping-pong with rank 0",
    "done": "nothing (done)",
}
"""What a rank was doing in each phase it reports (doctor_worker)."""
_HANG_FIX = (
    "a rank that never reports is stuck in init_process_group (see the *_SOCKET_IFNAME and MASTER_* checks "
    "above) or in a collective; rerun with NCCL_DEBUG=INFO NCCL_DEBUG_FILE=/tmp/nccl_rank_%r.log and read "
    "that rank's log (multi-node debugging: read the first rank that failed)."
)


def find_slow_ranks(times: Mapping[int, float], factor: float = 2.0) -> list[int]:
    """Ranks whose time is more than ``factor`` times the median of the *other* ranks' times.

    The median of the others, not of all ranks: with two ranks the median of both can never be exceeded
    twofold, and a slow rank should not raise the bar it is compared with."""
    slow = []
    for rank, t in sorted(times.items()):
        others = [v for q, v in times.items() if q != rank]
        if others and t > factor * statistics.median(others):
            slow.append(rank)
    return slow


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                stat = Path("/proc", entry, "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command may contain spaces and ")"
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        kids = tree.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _is_ours(pid: int) -> bool:
    try:
        return b"paratrain.diagnose.doctor_worker" in Path("/proc", str(pid), "cmdline").read_bytes()
    except OSError:
        return False


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)  # a rank is a session leader (torch starts it that way)
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_reports(out: Path, nproc: int) -> dict[int, dict[str, Any]]:
    reports = {}
    for rank in range(nproc):
        try:
            reports[rank] = json.loads((out / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            pass
    return reports


def run_selftest(nproc: int, timeout_s: float, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run the self-test on ``nproc`` local ranks; never takes much longer than ``timeout_s``.

    Returns the ``selftest`` object of ``paratrain doctor --json``."""
    env = dict(os.environ if env is None else env)
    # The self-test is a single-node job of its own: the launcher sets the rendezvous variables, and the
    # doctor checks the user's MASTER_ADDR / MASTER_PORT separately. The *_SOCKET_IFNAME ones are kept.
    child_env = {k: v for k, v in env.items() if k not in _JOB_VARS and not k.startswith("TORCHELASTIC_")}
    start = time.monotonic()
    deadline = time.time() + timeout_s
    margin = min(5.0, timeout_s * 0.25)  # the ranks stop themselves this long before the doctor kills them
    killed = False
    with tempfile.TemporaryDirectory(prefix="paratrain-doctor-") as tmp:
        out = Path(tmp)
        cmd = [
            sys.executable,
            "-m",
            "paratrain.diagnose.doctor_worker",
            "agent",
            "--out",
            tmp,
            "--nproc",
            str(nproc),
            "--deadline",
            repr(deadline - margin),
        ]
        with open(out / "agent.log", "w") as log:
            proc = subprocess.Popen(
                cmd,
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                killed = True
            # Kill what is left: after a timeout everything, else only ranks orphaned by a crashed agent.
            leftover = [p for p in _descendants(proc.pid) if killed or _is_ours(p)]
            reports = _read_reports(out, nproc)
            leftover += [
                r["pid"] for r in reports.values() if isinstance(r.get("pid"), int) and _is_ours(r["pid"])
            ]
            _kill(sorted(set(leftover)))
            if killed:
                _kill([proc.pid])
            proc.wait()
        reports = _read_reports(out, nproc)
        try:
            agent = json.loads((out / "agent.json").read_text())
        except (OSError, ValueError):
            agent = {"ok": False, "error": None, "failures": []}
        log_tail = (out / "agent.log").read_text(errors="replace").strip().splitlines()[-15:]
    return _summarize(nproc, timeout_s, time.monotonic() - start, killed, reports, agent, log_tail)


def _summarize(
    nproc: int,
    timeout_s: float,
    elapsed_s: float,
    killed: bool,
    reports: dict[int, dict[str, Any]],
    agent: dict[str, Any],
    log_tail: list[str],
) -> dict[str, Any]:
    ranks = []
    for rank in range(nproc):
        r = reports.get(rank, {})
        ranks.append(
            {
                "rank": rank,
                "pid": r.get("pid"),
                "reported": bool(r),
                "phase": r.get("phase"),
                "error": r.get("error"),
                "collectives": r.get("collectives", {}),
                "busbw": r.get("busbw", []),
                "p2p_s": r.get("p2p", {}),
            }
        )
    unfinished = [r["rank"] for r in ranks if r["phase"] != "done" and not r["error"]]
    failed = [r["rank"] for r in ranks if r["error"] or any(not c["ok"] for c in r["collectives"].values())]
    some = next((reports[k] for k in sorted(reports) if "backend" in reports[k]), {})
    result: dict[str, Any] = {
        "ran": True,
        "nproc": nproc,
        "backend": some.get("backend"),
        "device": some.get("device"),
        "timeout_s": round(timeout_s, 1),
        "elapsed_s": round(elapsed_s, 2),
        "killed_at_deadline": killed,
        "launch_error": agent.get("error"),
        "not_finished": unfinished,
        "failed": failed,
        "slow": [],
        "ranks": ranks,
    }
    if not reports and not agent.get("error"):
        result["log_tail"] = log_tail  # the agent itself failed: its output is all there is
    result["slow"] = _slow_ranks(ranks)
    return result


def _slow_ranks(ranks: list[dict[str, Any]]) -> list[int]:
    # all_reduce at the largest size (a collective ends together on every rank, so this rarely singles one
    # out), and the ping-pong with rank 0 (which does: rank q's pair alone is slow).
    largest = {r["rank"]: r["busbw"][-1]["time_s"] for r in ranks if r["busbw"]}
    pairs = {int(q): t for r in ranks if r["rank"] == 0 for q, t in r["p2p_s"].items()}
    return sorted(set(find_slow_ranks(largest)) | set(find_slow_ranks(pairs)))


def skipped(reason: str) -> dict[str, Any]:
    return {"ran": False, "reason": reason}


def _fmt_ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def selftest_checks(st: dict[str, Any]) -> list[Check]:
    """The doctor's lines for a self-test result: ``selftest collectives`` and ``selftest busbw``."""
    if not st.get("ran"):
        return [
            Check("selftest collectives", "fail", f"not run: {st.get('reason')}", "fix the failures above.")
        ]
    n, where = st["nproc"], f"{st['backend'] or '?'} on {st['device'] or '?'}"
    # A hang: a rank timed out waiting, or the doctor killed the job; the ranks that never reported are the
    # cause. Otherwise a rank failed and the launcher stopped the rest: the error is the cause.
    hang = st["killed_at_deadline"] or any((r["error"] or "").startswith("timed out") for r in st["ranks"])
    by_text: dict[str, list[int]] = {}  # one phrase per distinct problem, with the ranks that share it
    for r in st["ranks"]:
        phase = PHASES.get(r["phase"], str(r["phase"]))
        if r["error"] and r["error"].startswith("timed out"):
            text = f"waited in {phase} until the deadline"
        elif r["error"]:
            text = f"failed in {phase}: {r['error']}"
        elif not r["reported"]:
            text = "never started" if hang else "was stopped by the launcher before it started"
        elif r["phase"] != "done":
            killed = ", killed at the deadline" if st["killed_at_deadline"] else ""
            text = (
                f"did not report: stuck in {phase}{killed}"
                if hang
                else f"was stopped in {phase} by the launcher"
            )
        else:
            text = ""
        if text:
            by_text.setdefault(text, []).append(r["rank"])
        for name, c in r["collectives"].items():
            if not c["ok"]:
                by_text.setdefault(f"{name} {c['detail']}", []).append(r["rank"])
    cause = ("did not report", "never started") if hang else ("failed in",)
    order = sorted(by_text.items(), key=lambda kv: not kv[0].startswith(cause))
    problems = [f"{_fmt_ranks(ranks)} {text}" for text, ranks in order]
    if st["launch_error"] and (not problems or not any(r["reported"] for r in st["ranks"])):
        problems = [f"the launcher failed: {st['launch_error']}"]  # it refused to start, or died itself
    if not problems and all(r["phase"] == "done" for r in st["ranks"]):
        if n == 1:
            detail = (
                f"1 rank, {where}: every collective returned its own input (send/recv skipped); use 2 or "
                "more ranks to test communication"
            )
        else:
            detail = f"{n} ranks, {where}: {', '.join(COLLECTIVES)} exact on every rank"
        line = Check("selftest collectives", "ok", detail)
    else:
        detail = "; ".join(problems) or "the job failed without a report"
        if st.get("log_tail"):
            detail += " | " + " / ".join(st["log_tail"][-3:])
        fix = _HANG_FIX if hang else _fix_for(detail)
        line = Check("selftest collectives", "fail", detail, fix)
    return [line, *_busbw_checks(st)]


def _fix_for(detail: str) -> str:
    if "Unable to find address" in detail or "SOCKET_IFNAME" in detail:
        return (
            "set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to an interface with an address (see above), or "
            "unset it."
        )
    if "GPU" in detail or "nproc-per-node" in detail:
        return "use --nproc-per-node at most the GPU count."
    return "read the error above; rerun with NCCL_DEBUG=INFO (GPU) or TORCH_DISTRIBUTED_DEBUG=DETAIL."


def _busbw_checks(st: dict[str, Any]) -> list[Check]:
    measured = [r for r in st["ranks"] if r["busbw"]]
    if not measured or st["nproc"] == 1:
        return []
    size = measured[0]["busbw"][-1]["bytes"]
    parts = [f"rank {r['rank']} {r['busbw'][-1]['busbw_GBps']:.2f}" for r in measured]
    detail = f"all_reduce {size >> 20} MiB busbw GB/s: {', '.join(parts)}"
    pairs: dict[str, float] = next((r["p2p_s"] for r in st["ranks"] if r["rank"] == 0 and r["p2p_s"]), {})
    if pairs:
        detail += "; ping-pong 1 MiB with rank 0, one-way ms: " + ", ".join(
            f"rank {q} {t * 1e3:.2f}" for q, t in sorted(pairs.items(), key=lambda kv: int(kv[0]))
        )
    if st["slow"]:
        return [
            Check(
                "selftest busbw",
                "warning",
                f"{_fmt_ranks(st['slow'])} slow (over 2x the others' median): {detail}",
                "look at that rank's device and link (nvidia-smi topo -m, NCCL_DEBUG=INFO), or at other "
                "processes competing for its CPU.",
            )
        ]
    return [Check("selftest busbw", "ok", f"{detail}; no slow rank")]
