"""The worker's watcher thread: where the main thread is, and the multi-node path through the c10d store.

Once a second (a daemon thread; a worker blocked in a collective has released the GIL):

- it samples the main thread's stack (``sys._current_frames``) and writes the innermost user frame into
  the record, so that a post-mortem can say where a rank that never reached a collective *is*;
- in store mode (a multi-node job, where no launcher sees every rank's file, or no launcher at all: the
  bootstrap run under plain torchrun), it publishes a snapshot of the record under
  ``paratrain/guard/<restart>/rec/<rank>`` when it changed. Global rank 0's watcher reads all of them, runs
  the same analysis as the launcher (:mod:`analysis`), and on a finding prints it and sets the ``abort``
  key, which every rank's watcher polls: each rank then exits with status 1. Progress times are those the
  analyzing rank observed itself, so clocks of different nodes need not agree.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from typing import Any

from paratrain.diagnose.guard import analysis
from paratrain.diagnose.guard.record import RankView, RecordWriter, parse
from paratrain.diagnose.guard.recorder import _Sites
from paratrain.runtime import attempt


class Watcher:
    def __init__(self, writer: RecordWriter, sites: _Sites, interval_s: float = 1.0) -> None:
        self.writer = writer
        self.sites = sites
        self.interval_s = interval_s
        self.main_ident = threading.main_thread().ident
        self.stdlib = sysconfig.get_paths()["stdlib"] + os.sep
        self.store: Any = None
        self.rank = 0
        self.world = 1
        self.hang_timeout = 300.0
        self.report: Any = None
        self._prefix = ""
        self._published = -1
        self._seen: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratrain-guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def use_store(self, store: Any, rank: int, world: int, hang_timeout: float, report: Any) -> None:
        """Switch on store mode (after ``init_process_group``). ``report(message)`` prints a finding once."""
        self._prefix = f"paratrain/guard/{attempt()}/"
        self.rank, self.world, self.hang_timeout, self.report = rank, world, hang_timeout, report
        self.store = store
        self._publish(force=True)

    # -- where is the main thread --------------------------------------------------------------------------
    def where(self) -> str:
        frame = sys._current_frames().get(self.main_ident or 0)
        while frame is not None:
            name = frame.f_code.co_filename
            if not (self.sites.is_internal(name) or name.startswith(self.stdlib)):
                return f"{self.sites.name(name)}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame = frame.f_back
        return ""

    # -- store mode ------------------------------------------------------------------------------------------
    def _publish(self, force: bool = False) -> None:
        mark = self.writer.progress
        if force or mark != self._published:
            self.store.set(f"{self._prefix}rec/{self.rank}", self.writer.snapshot())
            self._published = mark

    def _views(self) -> dict[int, RankView] | None:
        keys = [f"{self._prefix}rec/{r}" for r in range(self.world)]
        if not self.store.check(keys):
            return None
        views: dict[int, RankView] = {}
        now = time.time()
        for r, raw in enumerate(self.store.multi_get(keys)):
            v = parse(bytes(raw))
            if v is None:
                return None
            seen = self._seen.get(r)
            if seen is None or seen[0] != v.progress:
                seen = self._seen[r] = (v.progress, now)
            v.t_change = seen[1]  # this rank's clock, not the remote one
            views[r] = v
        return views

    def _analyze(self) -> None:
        views = self._views()
        if views is None:
            return
        found = analysis.find_problem(views, self.world, time.time(), self.hang_timeout)
        if found is not None:
            self.report(found.message)
            self.store.set(f"{self._prefix}abort", found.message.encode())

    def _aborted(self) -> bool:
        return bool(self.store.check([f"{self._prefix}abort"]))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.writer.set_where(self.where())
                if self.store is None:
                    continue
                self._publish()
                if self.rank == 0:
                    self._analyze()
                if self._aborted():
                    sys.stderr.flush()
                    sys.stdout.flush()
                    os._exit(1)
            except Exception:
                if self.store is not None and self._stop.is_set():
                    return
                continue
