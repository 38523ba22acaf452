"""Which path a shared-memory collective takes, by measurement: the slots or the direct path.

The two copying paths of :mod:`paratrain.comm.shm` trade different costs. The slots copy with plain
``memcpy`` into and out of the segment (user space, no system call; fast while the tensors sit in the
caches), the direct path moves fewer bytes but through ``process_vm_readv``/``process_vm_writev`` (a
system call that pins the peer's pages; ahead once the tensors no longer fit in the caches). Where the
two cross depends on the host: on one small host the direct path won from 1 MB, on another, whose cores
copy in-cache memory 3-4x faster than ``process_vm_readv`` moves it, the slots won up to 4 MB at 2 ranks
and up to 16 MB at 4 (docs/benchmarks/shm.md). A fixed threshold is right on one
host only, so the communicator measures, per collective and per power-of-two size class, as a tuning
library picks a kernel by timing it:

- the first ``2·TRIALS`` calls of a class alternate slots, direct, slots, ... and time themselves;
- rank 0 compares the fastest call of each path and publishes the choice in its header line (two bits
  per class in one word per collective), right after its last trial call;
- call ``2·TRIALS`` (one more) takes the static rule (``direct_min_bytes``); from call ``2·TRIALS + 1``
  on, every rank reads rank 0's choice and keeps it.

**Why every rank takes the same path.** A call is counted only once it has succeeded, on every rank that
made it, whatever the device of its tensors (a rank whose tensor is not on the CPU takes the slots; if the
others took the direct path, the call signature, where the direct path marks its root -2, raises the same
``ValueError`` on every rank and nobody counts it). Every rank makes the same calls, so the counts agree;
and every counted call has an ARRIVE barrier (calls that move no bytes are not counted). Rank 0
publishes the choice before it starts call ``2·TRIALS``; a rank that starts call ``2·TRIALS + 1`` has
passed that call's ARRIVE barrier, so it has seen rank 0's ARRIVE flag and, stored before it, the choice
(the flag's release/acquire ordering of :mod:`paratrain.comm.shm`).

**What a trial measures.** Rank 0's own time of the call stands for the group's. The direct path ends in
a DONE barrier, so its time includes the slowest peer; the slots paths of broadcast, all_gather and
reduce_scatter end at their last ARRIVE barrier, before the peers have copied out, so a trial on the slots
ends with a DONE barrier too (trials only), or rank 0 would time the slots without the peers' copies and
charge them to the next call. The fastest of ``TRIALS`` calls is taken, not the mean: the late arrival of
a rank that waited for a core lands on either path alike, and a first call's page faults (slots touched
for the first time) on one. Calls with tensors off the CPU are counted but not timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

TRIALS = 3
"""Timed calls of each path per collective and size class before the choice."""
CALLS = 2 * TRIALS + 1
"""Calls of a size class after which every rank takes the chosen path from the next call on (a benchmark
warms up this many)."""
FUNCTIONS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
"""The collectives that have both paths; one header word each."""
_MAX_CLASS = 30  # two bits per class in a 64-bit word (62 bits used)


@dataclass(frozen=True)
class Ticket:
    """One call of a size class that is still being counted: its class and its index among them."""

    key: tuple[int, int]
    index: int


@dataclass
class _Class:
    calls: int = 0
    times: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})
    direct: bool | None = None


class PathTuner:
    """Per collective and size class, the path (direct or slots) measured fastest on this host.

    ``words``: rank 0's ``len(FUNCTIONS)`` header words (shared memory, written by rank 0 only);
    ``static_min_bytes``: the rule used before the choice is known (direct above it); ``min_bytes``: sizes
    at or below this always take the slots (the classes start above it). The tuner holds no reference to
    its communicator: a cycle between the two would leave the communicator, and the process group it holds,
    to the garbage collector at interpreter exit, where a Gloo worker thread that frees its last work then
    needs the GIL of a finalizing interpreter and aborts the process (seen in ``paratrain bench comm``).
    """

    def __init__(self, rank: int, words: np.ndarray, static_min_bytes: int, min_bytes: int) -> None:
        self.rank = rank
        self.words = words
        self.static_min_bytes = static_min_bytes
        self.min_bytes = min_bytes
        self.clock: Callable[[], float] = time.perf_counter
        """What trial calls are timed with (a test may script it)."""
        self._classes: dict[tuple[int, int], _Class] = {}
        self._base = min_bytes.bit_length()

    def size_class(self, nbytes: int) -> int:
        """0 for sizes above ``min_bytes`` below the next power of two, then one class per power of two
        (``[2^k, 2^(k+1))``); capped."""
        return min(_MAX_CLASS, max(0, nbytes.bit_length() - self._base))

    def pick(self, function: str, nbytes: int) -> tuple[bool, Ticket | None]:
        """The path of this call (``True``: direct) and, while its class is still counting calls, the
        ticket to hand to :meth:`done` once the call has succeeded. Nothing is counted here: a call that
        raises (a mismatch, after which the group stays usable) must not advance one rank's count."""
        if nbytes <= self.min_bytes:
            return False, None
        key = (FUNCTIONS.index(function), self.size_class(nbytes))
        c = self._classes.setdefault(key, _Class())
        if c.direct is not None:
            return c.direct, None
        index = c.calls
        if index < 2 * TRIALS:
            return index % 2 == 1, Ticket(key, index)
        if index == 2 * TRIALS:
            return nbytes > self.static_min_bytes, Ticket(key, index)
        bits = int(self.words[key[0]]) >> (2 * key[1])
        if not bits & 1:  # cannot happen while every rank makes the same calls (the signature checks)
            raise RuntimeError(
                f"shm {function}: rank 0 has not published the path of size class {key[1]} after "
                f"{index} calls; the ranks have not made the same sequence of calls."
            )
        c.direct = bool(bits & 2)
        return c.direct, None

    def done(self, ticket: Ticket, took_direct: bool, seconds: float | None) -> None:
        """The call of ``ticket`` succeeded on every rank, taking the direct path or not: count it, and
        keep its time (``None``: not timed, e.g. a tensor off the CPU) when it was a trial that took the
        path its trial stands for. After its last trial rank 0 publishes the path with the faster call
        (the slots when it has no timed call of the direct path), before it starts its next call."""
        c = self._classes[ticket.key]
        c.calls += 1
        if ticket.index >= 2 * TRIALS:
            return
        if seconds is not None and took_direct == (ticket.index % 2 == 1):
            c.times[took_direct].append(seconds)
        if self.rank != 0 or ticket.index != 2 * TRIALS - 1:
            return
        slots, direct = c.times[False], c.times[True]
        choice = bool(direct) and (not slots or min(direct) < min(slots))
        f, k = ticket.key
        self.words[f] = int(self.words[f]) | ((1 | (2 if choice else 0)) << (2 * k))  # only rank 0 writes
        # rank 0 too takes the choice only from call 2·TRIALS + 1 on, reading it back like every rank

    def is_trial(self, ticket: Ticket) -> bool:
        return ticket.index < 2 * TRIALS

    def path(self, function: str, nbytes: int) -> str | None:
        """``"direct"`` or ``"slots"``: the path a call of ``function`` on ``nbytes`` takes once tuned (slots
        at or below ``min_bytes``); ``None`` while its class is still being measured."""
        if function not in FUNCTIONS:
            raise ValueError(f"shm path: {function!r} is not one of the tuned collectives {FUNCTIONS}")
        if nbytes <= self.min_bytes:
            return "slots"
        low = {self.size_class(k): v for k, v in self.decisions().get(function, {}).items()}
        return low.get(self.size_class(nbytes))

    def decisions(self) -> dict[str, dict[int, str]]:
        """The paths chosen so far, as this rank knows them: collective -> {smallest size of the class
        (bytes) -> "direct" | "slots"}."""
        out: dict[str, dict[int, str]] = {}
        for (f, k), c in sorted(self._classes.items()):
            direct = c.direct
            if direct is None and c.calls > 2 * TRIALS:  # published, taken from the next call on
                bits = int(self.words[f]) >> (2 * k)
                direct = bool(bits & 2) if bits & 1 else None
            if direct is not None:
                low = 1 << (self._base + k - 1) if k else self.min_bytes + 1
                out.setdefault(FUNCTIONS[f], {})[low] = "direct" if direct else "slots"
        return out
