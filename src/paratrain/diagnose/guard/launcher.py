"""The launcher side of ``paratrain launch --guard``: the workers' argv, the monitor, the flags.

The launcher creates a guard directory (in ``/dev/shm`` when it exists), runs every rank through
:mod:`bootstrap`, and watches the ranks' record files from a thread of its own (:class:`GuardMonitor`). The
launcher outlives the workers and sees all local ranks' files, including those of a rank that died, so it
is where a hang or a mismatch is judged on one node; in a multi-node job it leaves that to the c10d store
path of the workers (:mod:`watch`), since no single launcher sees every file. On a finding the monitor
prints it and terminates the workers (SIGTERM, then SIGKILL after 3 s); the elastic agent then stops the
job and :func:`launch_guarded` returns 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

from paratrain.diagnose.guard.analysis import Finding, after_failure, find_problem
from paratrain.diagnose.guard.bootstrap import DEFAULT_DESYNC_EVERY, DEFAULT_HANG_TIMEOUT
from paratrain.diagnose.guard.record import RankView, read_file
from paratrain.diagnose.guard.summary import summarize, summary_json, summary_line
from paratrain.errors import ConfigError
from paratrain.procfs import pid_alive

BOOTSTRAP = "paratrain.diagnose.guard.bootstrap"


def add_guard_arguments(p: argparse.ArgumentParser) -> None:
    """``--guard``, ``--hang-timeout S``, ``--check-desync-every K`` (dests: guard, hang_timeout,
    check_desync_every)."""
    g = p.add_argument_group("guard (runtime checks of the script: docs/guard.md)")
    g.add_argument(
        "--guard",
        action="store_true",
        help="record collectives, stop a hang with a post-mortem, detect mismatched collectives, replica "
        "desync and data/placement mistakes",
    )
    g.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"with --guard: stop the job when a rank waits in a collective and no rank progressed for S "
        f"seconds (default {DEFAULT_HANG_TIMEOUT:.0f})",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help='with --guard: end with one JSON object on stdout, {"guard": {"collectives": ...}}, instead of '
        "the closing summary line on stderr",
    )
    g.add_argument(
        "--check-desync-every",
        type=int,
        default=None,
        metavar="K",
        help=f"with --guard: compare parameters and buffers across replicas every K optimizer steps "
        f"(default {DEFAULT_DESYNC_EVERY}; 0: never)",
    )


def resolve_guard_arguments(args: argparse.Namespace) -> None:
    """Refuse ``--hang-timeout``/``--check-desync-every`` without ``--guard`` (they would be ignored) and
    fill in the defaults (their values are checked by :func:`launch_guarded`). Raises :class:`ConfigError`."""
    from paratrain.errors import ConfigError

    given = [f for f, v in (("--hang-timeout", args.hang_timeout), ("--check-desync-every",
             args.check_desync_every)) if v is not None]  # fmt: skip
    if given and not args.guard:
        raise ConfigError(
            f"{' and '.join(given)} only act(s) with --guard, which is not given: add --guard, or leave "
            f"{' and '.join(given)} out."
        )
    if args.hang_timeout is None:
        args.hang_timeout = DEFAULT_HANG_TIMEOUT
    if args.check_desync_every is None:
        args.check_desync_every = DEFAULT_DESYNC_EVERY


def guarded_entry(
    script: str,
    script_args: list[str],
    hang_timeout: float = DEFAULT_HANG_TIMEOUT,
    desync_every: int = DEFAULT_DESYNC_EVERY,
    guard_dir: str | None = None,
    module: bool = False,
) -> list[str]:
    """The argv (after ``python``) for the elastic agent: the bootstrap, then ``script`` (or ``-m module``)."""
    entry = [
        "-u",
        "-m",
        BOOTSTRAP,
        "--hang-timeout",
        str(hang_timeout),
        "--check-desync-every",
        str(desync_every),
    ]
    if guard_dir is not None:
        entry += ["--guard-dir", guard_dir]
    return [*entry, "--", *(["-m"] if module else []), script, *script_args]


def _liveness(views: dict[int, RankView]) -> Callable[[int], bool]:
    pids = {r: v.pid for r, v in views.items()}
    return lambda r: pid_alive(pids[r])


class GuardMonitor:
    """Watches ``guard_dir/rank*.rec`` from a thread; on a mismatch or a hang prints the finding (``stream``)
    and terminates the workers. ``finding`` holds what was reported, if anything."""

    def __init__(
        self, guard_dir: str, hang_timeout: float, poll_s: float = 0.5, stream: TextIO | None = None
    ) -> None:
        self.guard_dir = guard_dir
        self.hang_timeout = hang_timeout
        self.poll_s = poll_s
        self.stream = stream
        self.finding: Finding | None = None
        self.stopped = False
        """True when the monitor itself terminated the workers."""
        self._killed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratrain-guard-monitor", daemon=True)

    def __enter__(self) -> GuardMonitor:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.finding is None and self.worker_finding() is None:
            views = self.read()
            if views and len(views) >= max(v.world for v in views.values()):
                world = max(v.world for v in views.values())
                found = after_failure(views, world, time.time())
                if found is not None:
                    self._say(found)
                    self.finding = found

    def read(self) -> dict[int, RankView]:
        views: dict[int, RankView] = {}
        try:
            names = os.listdir(self.guard_dir)
        except OSError:
            return views
        for name in names:
            if name.startswith("rank") and name.endswith(".rec"):
                v = read_file(os.path.join(self.guard_dir, name))
                if v is not None:
                    views[v.rank] = v
        return views

    def worker_finding(self) -> str | None:
        """A fatal finding a worker reported itself (a desync), if any."""
        try:
            with open(os.path.join(self.guard_dir, "finding")) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def _say(self, found: Finding) -> None:
        stream = self.stream or sys.stderr
        stream.write(f"paratrain guard: {found.message}\n")
        stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            # after a stop, the elastic agent may restart the workers (--max-restarts): judge the new ones
            views = {r: v for r, v in self.read().items() if v.pid not in self._killed}
            if not views:
                continue
            world = max(v.world for v in views.values())
            if len(views) < world:
                continue  # not all started yet, or a multi-node job: the store path judges it
            found = find_problem(views, world, time.time(), self.hang_timeout, _liveness(views))
            if found is None:
                continue
            self.finding = found
            self._say(found)
            self.stopped = True
            pids = [v.pid for v in views.values()]
            self._killed.update(pids)
            self._terminate(pids)

    def _terminate(self, pids: list[int]) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                if pid_alive(pid):
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
                time.sleep(0.05)


def _guard_dir_parent() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def launch_guarded(
    script: str,
    script_args: list[str],
    launch_cfg: Any,
    hang_timeout: float = DEFAULT_HANG_TIMEOUT,
    desync_every: int = DEFAULT_DESYNC_EVERY,
    module: bool = False,
    json_summary: bool = False,
) -> int:
    """``paratrain launch --guard``: run ``script`` on every local rank under the guard; the exit status.

    Prints a guard finding (or the launcher's failure paragraph) to stderr. A job that ends well ends with
    one line naming what was checked (:mod:`summary`), printed by the launcher that sees rank 0's record;
    with ``json_summary``, one JSON object on stdout instead. Raises :class:`ConfigError` for a bad input,
    before anything starts.
    """
    from paratrain.launch import LaunchError, run_module

    if not module and not os.path.isfile(script):
        raise ConfigError(f"script {script!r} does not exist. Give the path of a Python file to run.")
    if not 0 < hang_timeout < float("inf"):  # NaN too
        raise ConfigError(f"--hang-timeout must be a finite number > 0 of seconds, got {hang_timeout!r}.")
    if desync_every < 0:
        raise ConfigError(f"--check-desync-every must be >= 0 (0: never), got {desync_every!r}.")
    guard_dir = tempfile.mkdtemp(prefix="paratrain-guard-", dir=_guard_dir_parent())
    failed: LaunchError | None = None
    try:
        entry = guarded_entry(script, script_args, hang_timeout, desync_every, guard_dir, module)
        with GuardMonitor(guard_dir, hang_timeout) as monitor:
            try:
                run_module(BOOTSTRAP, entry[3:], launch_cfg)
            except LaunchError as e:
                failed = e
        if failed is not None:
            if monitor.stopped or monitor.worker_finding() is not None:
                print("paratrain guard: the job was stopped (exit status 1)", file=sys.stderr)
            else:
                print(f"paratrain launch: {failed}", file=sys.stderr)
            return 1
        # a mismatch found after a job that ended "well": some collective computed with the wrong data
        if monitor.finding is not None and not monitor.stopped:
            return 1
        views = monitor.read()
        if 0 in views:  # the node that ran rank 0 says what was checked; the others stay quiet
            s = summarize(views)
            if json_summary:
                print(summary_json(s), flush=True)
            else:
                print(summary_line(s), file=sys.stderr, flush=True)
        return 0
    finally:
        shutil.rmtree(guard_dir, ignore_errors=True)
