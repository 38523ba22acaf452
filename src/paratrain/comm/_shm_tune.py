"""Which path a shared-memory collective takes, by measurement: the slots or the direct path.

The two copying paths of :mod:`paratrain.comm.shm` trade different costs. The slots copy with plain
``memcpy`` into and out of the segment (user space, no system call; fast while the tensors sit in the
caches), the direct path moves fewer bytes but through ``process_vm_readv``/``process_vm_writev`` (a
system call that pins the peer's pages; ahead once the tensors no longer fit in the caches). Where the
two cross depends on the host: on one 2-core VM the direct path won from 1 MB, on another, whose cores
copy in-cache memory 3-4x faster than ``process_vm_readv`` moves it, the slots won up to 4 MB at 2 ranks
and up to 16 MB at 4 (``BENCHMARKS.md``, "Shared-memory collectives"). A fixed threshold is right on one
host only, so the communicator measures, per collective and per power-of-two size class, as a tuning
library picks a kernel by timing it:

- the first ``2·TRIALS`` calls of a class alternate slots, direct, slots, ... and time themselves;
- rank 0 compares the fastest call of each path and publishes the choice in its header line (two bits
  per class in one word per collective), right after its last trial call;
- call ``2·TRIALS`` (one more) takes the static rule (``direct_min_bytes``); from call ``2·TRIALS + 1``
  on, every rank reads rank 0's choice and keeps it.

**Why every rank takes the same path.** The calls of a class are counted the same on every rank (every
rank makes the same collectives with the same sizes, which the call signature checks), and each call has an
ARRIVE barrier. Rank 0 publishes the choice before it starts call ``2·TRIALS``; a rank that starts call
``2·TRIALS + 1`` has passed that call's ARRIVE barrier, so it has seen rank 0's ARRIVE flag and, stored
before it, the choice (the flag's release/acquire ordering of :mod:`paratrain.comm.shm`). Were the ranks
ever to disagree, the call signature (the direct path marks its root -2) would raise the same
``ValueError`` on every rank instead of corrupting memory.

Rank 0's own time stands for the group's: both paths end in a barrier (DONE, REDUCED), so a call's time
on rank 0 includes its slowest peer. The fastest of ``TRIALS`` calls is taken, not the mean: the late
arrival of a rank that waited for a core lands on either path alike, and a first call's page faults
(slots touched for the first time) on one.
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

    def pick(self, function: str, nbytes: int) -> tuple[bool, tuple[int, int] | None]:
        """The path of this call (``True``: direct) and, for a trial call, the key to :meth:`record`."""
        if nbytes <= self.min_bytes:
            return False, None
        key = (FUNCTIONS.index(function), self.size_class(nbytes))
        c = self._classes.setdefault(key, _Class())
        if c.direct is not None:
            return c.direct, None
        calls, c.calls = c.calls, c.calls + 1
        if calls < 2 * TRIALS:
            return calls % 2 == 1, key
        if calls == 2 * TRIALS:
            return nbytes > self.static_min_bytes, None
        bits = int(self.words[key[0]]) >> (2 * key[1])
        if not bits & 1:  # cannot happen while every rank makes the same calls (the signature checks)
            raise RuntimeError(
                f"shm {function}: rank 0 has not published the path of size class {key[1]} after "
                f"{calls} calls; the ranks have not made the same sequence of calls."
            )
        c.direct = bool(bits & 2)
        return c.direct, None

    def undo(self, function: str, nbytes: int) -> None:
        """Take back the count of a call that :meth:`pick` let through and that then raised a mismatch
        (the ranks disagreed on the call; every rank raises it at the same call, and the group stays
        usable), so that the counts still agree on every rank."""
        if nbytes <= self.min_bytes:
            return
        c = self._classes.get((FUNCTIONS.index(function), self.size_class(nbytes)))
        if c is not None and c.direct is None and c.calls:
            c.calls -= 1

    def record(self, key: tuple[int, int], direct: bool, seconds: float) -> None:
        """A trial call took ``seconds``; rank 0 publishes the choice after the last trial."""
        c = self._classes[key]
        c.times[direct].append(seconds)
        if self.rank != 0 or len(c.times[False]) < TRIALS or len(c.times[True]) < TRIALS:
            return
        direct = min(c.times[True]) < min(c.times[False])
        f, k = key
        word = int(self.words[f]) | ((1 | (2 if direct else 0)) << (2 * k))
        self.words[f] = word  # rank 0's own line: only it writes there
        # rank 0 too takes the choice only from call 2·TRIALS + 1 on, reading it back like every rank

    def path(self, function: str, nbytes: int) -> str | None:
        """``"direct"`` or ``"slots"``: the path a call of ``function`` on ``nbytes`` takes once tuned (slots
        at or below ``min_bytes``); ``None`` while its class is still being measured."""
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
