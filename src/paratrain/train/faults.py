"""Fault injection (for users and tests) and naming the peer that died.

Fault injection:

- ``--fail-at-step S [--fail-rank R]``: rank R SIGKILLs itself right after optimizer step S, on the first
  attempt only (:func:`paratrain.runtime.attempt` ``== 0``), so that ``--max-restarts`` brings the run back and the
  resume path is exercised exactly like a real crash (no ``finally`` blocks, no flushing, no goodbye).
- ``PARATRAIN_FAIL_CKPT_WRITE=R``: rank R's checkpoint writer raises while writing its data, to exercise
  the error path of (async) saves (:func:`checkpoint_writer_factory`, above storage).

Dead or hung peers (:class:`PeerMonitor`): a daemon thread on every rank bumps a counter in the c10d store
once per ``interval_s`` and publishes the rank's current step. When a collective fails (a dead peer closes
its sockets: Gloo raises at once; a hung peer: the collective hits the process-group timeout),
:func:`peer_guard` reads every rank's counter twice, ``2.5 * interval_s`` apart, and re-raises the error
naming the ranks whose counter stopped (dead or frozen) or whose step lags the others (alive but stuck).
The thread also watches its ring neighbour and logs as soon as that one goes silent, which is the only
message left when an NCCL watchdog tears the process down instead of raising.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from paratrain.runtime import Context, launcher_gone


class PeerLostError(RuntimeError):
    """A collective failed because a peer died or stopped making progress; names the rank(s)."""


# ---- fault injection -------------------------------------------------------------------------------------
def maybe_fail(step: int, ctx: Context, fail_at_step: int | None, fail_rank: int = 0) -> None:
    """SIGKILL this process after ``step`` if it is the configured rank, on the first attempt only."""
    if fail_at_step is None or step != fail_at_step or ctx.rank != fail_rank or ctx.restart_count != 0:
        return
    print(
        f"[paratrain] fault injection: rank {ctx.rank} kills itself (SIGKILL) at step {step}",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_writer_factory(rank: int) -> Any:
    """The checkpoint writer of this rank: the hashing DCP writer, or (fault injection,
    ``PARATRAIN_FAIL_CKPT_WRITE=R`` names this rank) one whose data write raises."""
    from paratrain.checkpoint.integrity import HashingWriter

    if os.environ.get("PARATRAIN_FAIL_CKPT_WRITE") != str(rank):
        return None  # the manager's default

    class FailingWriter(HashingWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            raise OSError(f"injected checkpoint write failure on rank {rank} (PARATRAIN_FAIL_CKPT_WRITE)")

    return FailingWriter


# ---- peer liveness -------------------------------------------------------------------------------------
class PeerMonitor:
    """Heartbeat counters in the c10d store; :meth:`lost` names the ranks that stopped."""

    def __init__(self, ctx: Context, interval_s: float = 1.0, store: Any = None) -> None:
        self.ctx = ctx
        self.interval_s = interval_s
        self.step = 0
        """Set by the training loop; published with every beat."""
        self._store = store if store is not None else dist.distributed_c10d._get_default_store()
        self._prefix = f"paratrain/peers/{ctx.restart_count}/"
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="paratrain-heartbeat", daemon=True)
        self._beat(0)
        self._thread.start()

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _beat(self, n: int) -> None:
        self._store.set(self._key(self.ctx.rank), f"{n}:{self.step}")

    def _read(self) -> dict[int, tuple[int, int] | None]:
        out: dict[int, tuple[int, int] | None] = {}
        for r in range(self.ctx.world_size):
            key = self._key(r)
            try:
                if not self._store.check([key]):
                    out[r] = None
                    continue
                n, step = self._store.get(key).decode().split(":")
                out[r] = (int(n), int(step))
            except Exception:
                out[r] = None
        return out

    def _run(self) -> None:
        n, failures = 0, 0
        neighbour = (self.ctx.rank + 1) % self.ctx.world_size
        last_seen, last_change = None, time.monotonic()
        while not self._stop.wait(self.interval_s):
            n += 1
            try:
                self._beat(n)
                failures = 0
                if neighbour == self.ctx.rank:
                    continue
                value = self._read_one(neighbour)
            except Exception as e:
                failures += 1
                if self._stop.is_set():
                    return
                if failures >= 2 and not launcher_gone():
                    # The store is hosted elsewhere (another node's agent in a multi-node job) and that node
                    # is gone: this rank's next collective fails and names it; the local launcher restarts
                    # or stops the group. Only stop beating.
                    return
                if failures >= 2:  # the store lives in our launcher, and the launcher is gone: so is the job
                    print(
                        f"[paratrain] rank {self.ctx.rank}: the launcher's store stopped answering "
                        f"({type(e).__name__}); the job is gone, exiting",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(1)
                continue
            now = time.monotonic()
            if value != last_seen:
                last_seen, last_change = value, now
            elif not self._warned and now - last_change > max(5.0, 5 * self.interval_s):
                self._warned = True
                print(
                    f"[paratrain] rank {self.ctx.rank}: rank {neighbour} sent no heartbeat for "
                    f"{now - last_change:.0f}s (dead or frozen)",
                    file=sys.stderr,
                    flush=True,
                )

    def _read_one(self, rank: int) -> str | None:
        key = self._key(rank)
        return self._store.get(key).decode() if self._store.check([key]) else None

    def lost(self) -> tuple[list[int], list[int]]:
        """``(silent, stuck)``: ranks whose heartbeat stopped, and live ranks behind the others' step."""
        first = self._read()
        time.sleep(2.5 * self.interval_s)
        second = self._read()
        silent = [r for r in second if r != self.ctx.rank and (second[r] is None or second[r] == first[r])]
        steps = {r: v[1] for r, v in second.items() if v is not None and r not in silent}
        top = max(steps.values(), default=0)
        stuck = [r for r, s in steps.items() if s < top and r != self.ctx.rank]
        return silent, stuck

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)


def describe_lost(silent: list[int], stuck: list[int], step: int) -> str:
    parts = []
    if silent:
        who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {silent}"
        parts.append(f"{who} stopped responding (process dead or frozen: no heartbeat)")
    if stuck:
        parts.append(f"rank(s) {stuck} are alive but did not reach step {step} (stuck)")
    return "; ".join(parts) or "no peer could be named (every heartbeat is still advancing)"


def _is_comm_error(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(
        s in text
        for s in ("connection closed", "connection reset", "timed out", "timeout", "broken pipe", "gloo")
    )


@contextlib.contextmanager
def peer_guard(ctx: Context, interval_s: float = 1.0) -> Iterator[PeerMonitor | None]:
    """Run a block with a :class:`PeerMonitor`; a communication failure inside it is re-raised as
    :class:`PeerLostError` naming the missing rank(s). A no-op without a process group."""
    if not ctx.distributed or ctx.world_size < 2:
        yield None
        return
    mon = PeerMonitor(ctx, interval_s)
    try:
        yield mon
    except Exception as e:
        if not _is_comm_error(e):
            raise
        silent, stuck = mon.lost()
        # The dead rank first: this rank (the one raising) only noticed it.
        raise PeerLostError(
            f"{describe_lost(silent, stuck, mon.step + 1)}; noticed by rank {ctx.rank} when a collective "
            f"failed at step {mon.step + 1}. Cause: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    finally:
        mon.close()
