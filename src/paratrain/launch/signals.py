"""What the launching process (the elastic agent) does on SIGTERM and SIGUSR1: the workers save, then stop.

torch's agent handles SIGTERM by tearing the workers down at once (``launcher/api.py`` ``signals_to_handle``;
``elastic/multiprocessing/api.py`` ``_terminate_process_handler`` raises ``SignalException``; the agent then
sends the signal to the workers and SIGKILLs them after ``shutdown_timeout``) and leaves by that exception:
no summary, and in a multi-node job the other agents wait at the exit barrier for one that never comes.
paratrain takes SIGTERM and SIGUSR1 out of torch's list and installs :class:`StopForwarder` instead.

Reference: https://pytorch.org/docs/stable/elastic/agent.html
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

from paratrain.procfs import child_pids, pid_alive

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


REPEAT_S = 2.0
"""A stop signal this soon after the first is a copy of it (see :class:`StopForwarder`)."""


class StopForwarder:
    """SIGTERM/SIGUSR1 in the agent: the workers save a checkpoint and stop, then the agent exits normally.

    1. forwards the signal to the local workers (their handler only sets a flag; the ranks agree on a step
       through the per-step flag all-reduce, save there, and exit 0: see checkpoint/lifecycle.py);
    2. lets the agent go on monitoring: it sees the group succeed and returns normally;
    3. escalates to torch's teardown (signal again, SIGKILL after ``shutdown_timeout``) when a second signal
       arrives, when the workers have not exited ``grace_s`` after the first, or when no worker runs yet
       (the agent is in a rendezvous: nothing to save). A second signal within ``REPEAT_S`` of the first is
       the same request, not a second one: ``timeout``, ``kill -TERM -PGID`` and Slurm signal the launcher
       both directly and through its process group;
    4. after a stop signal, never restarts: :class:`GuardedRendezvous` turns the next rendezvous (what a
       restart does first) into the same teardown.
    """

    def __init__(self, grace_s: float) -> None:
        import threading

        self.grace_s = grace_s
        self.received: signal.Signals | None = None
        self._received_at = 0.0
        self._escalating = False
        self.before_workers = False
        self._old: dict[int, Any] = {}
        # The handler must not take locks the interrupted main thread may hold (starting a thread does, and
        # so does print): it only sets this event; a watcher thread, started beforehand, does the waiting.
        self._stop_requested = threading.Event()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="paratrain-stop-grace", daemon=True)

    def install(self) -> None:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
            self._watcher.start()

    def restore(self) -> None:
        self._closed.set()
        self._stop_requested.set()  # wakes the watcher, which sees _closed and returns
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def teardown(self, sig: signal.Signals) -> Exception:
        from torch.distributed.elastic.multiprocessing import SignalException

        return SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)

    def _handle(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        workers = _live_child_pids(os.getpid())
        if self.received is None and not workers:
            self.received, self.before_workers = sig, True
        if self.received is not None:
            repeat = not self._escalating and time.monotonic() - self._received_at < REPEAT_S
            if repeat and not self.before_workers:
                return  # the same request delivered twice (directly and to the process group)
            raise self.teardown(self.received)
        self.received, self._received_at = sig, time.monotonic()
        for pid in workers:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        os.write(
            2,
            (
                f"[paratrain] {sig.name}: the workers save a checkpoint and stop (escalating if they have "
                f"not exited in {self.grace_s:.0f}s, or on a second signal)\n"
            ).encode(),
        )
        self._stop_requested.set()

    def _watch(self) -> None:
        self._stop_requested.wait()
        if self._closed.wait(self.grace_s) or self.received is None:
            return
        if _live_child_pids(os.getpid()):
            # Python runs signal handlers in the main thread: re-sending the signal makes the handler above
            # raise there, i.e. torch's teardown from wherever the agent is (monitor loop, exit barrier).
            self._escalating = True
            os.kill(os.getpid(), self.received)


class NoRestartError(RuntimeError):
    """A worker failed in a way no restart can change; ``str()`` is the report. Raised by
    :class:`GuardedRendezvous` in place of the restart's rendezvous."""


def no_restart_report(path: str | None, max_restarts: int) -> str | None:
    """The report of a failure recorded in the no-restart file (:func:`paratrain.runtime.record_errors`),
    or ``None`` when no worker recorded one."""
    import json

    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as fp:
            record = json.load(fp)
        rank, message, reason = record["rank"], record["message"], record["reason"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (
        f"rank {rank} failed: {message}\n  not restarted (--max-restarts {max_restarts} left unused): {reason}. "
        "Fix the cause and run again."
    )


class GuardedRendezvous:
    """A rendezvous handler that refuses to start another round once a stop signal was received (so a
    worker that dies while stopping does not make the agent restart the group) or once a worker recorded
    a failure that no restart can fix (:class:`NoRestartError`), and gives the round's
    workers on every node the same attempt (``PARATRAIN_ATTEMPT``) and a store prefix of their own
    (``PARATRAIN_ROUND_KEY``); everything else is the wrapped handler's.

    torch's ``TORCHELASTIC_RESTART_COUNT`` is per agent: when a worker dies on one node, that agent counts a
    restart and the others, restarting for the membership change, do not (pytorch#135712). Workers that
    prefixed their store keys with it then waited for each other under different prefixes until the
    timeout. Here the round's first agent (rank 0 of the rendezvous) writes its count and a fresh token
    into the round's store; every agent reads them and puts them in its environment, which the workers
    it starts next inherit (:func:`paratrain.runtime.attempt`, :func:`~paratrain.runtime.attempt_key`)."""

    def __init__(
        self, inner: Any, name: str, stop: StopForwarder, no_restart: str | None = None, max_restarts: int = 0
    ) -> None:
        self._inner, self._name, self._stop = inner, name, stop
        self._no_restart, self._max_restarts = no_restart, max_restarts
        self._rounds = 0
        self._store: Any = None  # the last round's store, shared by every node's agent

    def next_rendezvous(self) -> Any:
        if self._stop.received is not None:
            raise self._stop.teardown(self._stop.received)
        report = no_restart_report(self._no_restart, self._max_restarts) if self._rounds else None
        if report is not None:
            self._share(report)
            raise NoRestartError(report)
        if self._rounds:
            shared = self._shared()  # another node's worker failed in a way no restart can fix
            if shared is not None:
                raise NoRestartError(shared)
        try:
            info = self._inner.next_rendezvous()
        except Exception as e:
            # a node that ended the job closed the rendezvous, or took its store with it when it hosted it: say
            # so once (with its report when it could be read) instead of torch's traceback
            kind = type(e).__name__
            if not self._rounds or kind not in ("RendezvousClosedError", "RendezvousConnectionError"):
                raise
            why = (
                "closed the rendezvous" if kind == "RendezvousClosedError" else "hosted the rendezvous store"
            )
            raise NoRestartError(
                self._shared()
                or f"the job ended on another node (it {why}) after a worker failed; that node's log says why. "
                "Not restarted."
            ) from None
        self._rounds += 1
        store, rank = (info.store, info.rank) if hasattr(info, "store") else (info[0], info[1])
        self._store = store
        if rank == 0:
            store.set(ROUND_KEY, f"{self._rounds - 1} {uuid.uuid4().hex[:12]}")
        count, token = store.get(ROUND_KEY).decode().split()  # waits for rank 0's
        os.environ["PARATRAIN_ATTEMPT"] = count
        os.environ["PARATRAIN_ROUND_KEY"] = f"{count}-{token}"
        return info

    def num_nodes_waiting(self) -> int:
        """torch's agent polls this while its workers run. A node that ended the job for good (and hosted the
        rendezvous store, or closed the rendezvous) makes it fail: that is "no node waiting", and the agent
        goes on to notice its own failed workers and to :meth:`next_rendezvous`, which reports it."""
        try:
            return int(self._inner.num_nodes_waiting())
        except Exception as e:
            if type(e).__name__ in ("RendezvousClosedError", "RendezvousConnectionError"):
                return 0
            raise

    def _share(self, report: str) -> None:
        """Put this node's no-restart report in the round's store, where the other nodes' agents look before
        (and instead of) their next rendezvous; best effort (the store may be gone with its host)."""
        try:
            if self._store is not None:
                self._store.set(NO_RESTART_KEY, f"on another node: {report}")
        except Exception:  # a lost store only loses the other nodes' clearer message
            pass

    def _shared(self) -> str | None:
        """Another node's no-restart report from the last round's store, or ``None``."""
        try:
            if self._store is not None and self._store.check([NO_RESTART_KEY]):
                return bytes(self._store.get(NO_RESTART_KEY)).decode()
        except Exception:  # its host has exited: nothing to read
            pass
        return None

    def get_backend(self) -> str:
        return self._name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


NO_RESTART_KEY = "paratrain/no_restart"
"""Key of a round's store where the agent of a node whose worker failed for good leaves its report."""

ROUND_KEY = "paratrain/round"
"""Key of the round's store (prefixed per round by torch's c10d rendezvous) that rank 0 writes the attempt to."""


def guarded_backend(
    backend: str, stop: StopForwarder, no_restart: str | None = None, max_restarts: int = 0
) -> str:
    """Register ``paratrain-guarded-<n>``: ``backend``'s handler wrapped in :class:`GuardedRendezvous`."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    name = f"paratrain-guarded-{uuid.uuid4().hex[:8]}"

    def create(params: Any) -> Any:
        inner = registry.create_handler(
            RendezvousParameters(
                backend,
                params.endpoint,
                params.run_id,
                params.min_nodes,
                params.max_nodes,
                params.local_addr,
                **params.config,
            )
        )
        return GuardedRendezvous(inner, name, stop, no_restart, max_restarts)

    registry.register(name, create)
    return name


def _live_child_pids(pid: int) -> list[int]:
    """Children of ``pid`` that run (an exited, not yet reaped worker is not one)."""
    return [child for child in child_pids(pid) if pid_alive(child)]


def stop_children(timeout_s: float) -> None:
    """SIGINT this process's running children (as torch's teardown after Ctrl-C does), then SIGKILL those
    still running after ``timeout_s``."""
    children = _live_child_pids(os.getpid())
    for sig in (signal.SIGINT, signal.SIGKILL):
        for pid in children:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (timeout_s if sig == signal.SIGINT else 5.0)
        while children and time.monotonic() < deadline:
            time.sleep(0.05)
            children = _live_child_pids(os.getpid())
        if not children:
            return


def grace_s(timeout_s: float) -> float:
    """How long the workers get to save and exit after SIGTERM/SIGUSR1 before the agent tears them down:
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` if set, else the process-group timeout (a worker that has not stopped
    by then is stuck in a collective that is about to fail anyway), at least 30 s."""
    env = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    return float(env) if env else max(30.0, timeout_s)


def describe_teardown(sig: signal.Signals, stop: StopForwarder, shutdown_timeout: Any) -> str:
    """The launcher's one-paragraph report when the agent tore the workers down after a signal."""
    if stop.received is None:  # SIGINT, SIGHUP, SIGQUIT: torch's own teardown
        return (
            f"interrupted by {sig.name}: the workers were stopped without a checkpoint (SIGTERM or SIGUSR1 "
            "make them save first); the next run resumes from the latest committed checkpoint"
        )
    if stop.before_workers:
        return (
            f"stopped by {sig.name} before any worker was running (nothing to save); the next run resumes "
            "from the latest committed checkpoint"
        )
    return (
        f"stopped by {stop.received.name}, but the workers did not all save and exit (a second signal, "
        f"{stop.grace_s:.0f}s passed, or a worker died while stopping): they were sent {sig.name} and killed "
        f"after {shutdown_timeout}s. Rerunning resumes from the latest committed checkpoint."
    )
