"""The α–β(–γ) cost model of every algorithm in :mod:`paratrain.comm`, and nccl-tests' bandwidth formulas.

A message of m bytes between two ranks costs α + mβ (α: latency per message, β: seconds per byte, the
inverse link bandwidth); reducing m bytes costs mγ. S is the message size as nccl-tests defines it: the
tensor of all_reduce / broadcast / reduce, the whole *gathered* array of all_gather, the whole *input*
of reduce_scatter. n is the number of ranks. The formulas are the ones in each algorithm module's
docstring (Thakur, Rabenseifner & Gropp, IJHPCA 2005; Patarasuk & Yuan, JPDC 2009):

=================  =============================  =================================================
collective         algorithm                      time
=================  =============================  =================================================
broadcast          naive                          (n−1)(α + Sβ)
broadcast          tree                           ⌈log2 n⌉(α + Sβ)
reduce             naive                          (n−1)(α + Sβ + Sγ)
reduce             tree                           ⌈log2 n⌉(α + Sβ + Sγ)
all_reduce         naive                          2(n−1)(α + Sβ) + (n−1)Sγ
all_reduce         tree                           2⌈log2 n⌉(α + Sβ) + ⌈log2 n⌉Sγ
all_reduce         ring (P pieces per chunk)      2(n−1)Pα + 2(n−1)/n·Sβ + (n−1)/n·Sγ
all_reduce         rhd (p = 2^⌊log2 n⌋)           2·log2(p)·α + 2(p−1)/p·Sβ + (p−1)/p·Sγ [+ 2(α+Sβ) + Sγ if n≠p]
all_gather         naive                          2(n−1)α + (n−1)(1 + 1/n)Sβ
all_gather         ring                           (n−1)Pα + (n−1)/n·Sβ
reduce_scatter     naive                          2(n−1)α + (n−1)(1 + 1/n)Sβ + (n−1)Sγ
reduce_scatter     ring                           (n−1)Pα + (n−1)/n·Sβ + (n−1)/n·Sγ
=================  =============================  =================================================

Bandwidths (nccl-tests, doc/PERFORMANCE.md): algbw = S / t, and busbw = algbw × factor, with factor
2(n−1)/n for all_reduce, (n−1)/n for all_gather and reduce_scatter, 1 for broadcast and reduce. busbw
is comparable across collectives and world sizes: it is the bandwidth each rank's link actually carries
under the optimal algorithm, so it should approach the link bandwidth 1/β.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PIECE_BYTES = 4 << 20
"""The ring's default pipelining granularity (:mod:`paratrain.comm.ring`). Smaller pieces overlap more but
pay α per piece."""

BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
"""nccl-tests' busbw/algbw factor for each collective, as a function of the number of ranks."""


@dataclass(frozen=True)
class LinkModel:
    """Measured parameters of the α–β–γ model."""

    alpha: float
    """Seconds per message (latency)."""
    beta: float
    """Seconds per byte on one link (1 / bandwidth)."""
    gamma: float = 0.0
    """Seconds per byte to reduce two buffers into one."""


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw for ``collective`` on ``n`` ranks (nccl-tests' definition; point-to-point: 1)."""
    if collective == "send_recv":
        return 1.0
    if collective not in BUS_FACTORS:
        raise ValueError(
            f"no bus bandwidth factor for {collective!r}; choose one of {', '.join(BUS_FACTORS)}."
        )
    return float(BUS_FACTORS[collective](n))


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: S / t."""
    return nbytes / seconds if seconds > 0 else float("inf")


def busbw(collective: str, n: int, nbytes: float, seconds: float) -> float:
    """Bus bandwidth in bytes/s: algbw × :func:`bus_factor`."""
    return algbw(nbytes, seconds) * bus_factor(collective, n)


def ring_pieces(nbytes: float, n: int, piece_bytes: int = PIECE_BYTES) -> int:
    """Pieces per chunk in :mod:`paratrain.comm.ring` for a message of ``nbytes`` (S) on ``n`` ranks."""
    chunk = math.ceil(nbytes / n)
    return max(1, math.ceil(chunk / piece_bytes))


def predict(
    collective: str, algorithm: str, n: int, nbytes: float, m: LinkModel, piece_bytes: int = PIECE_BYTES
) -> float | None:
    """Predicted seconds of ``collective`` with ``algorithm``; ``None`` for ``native`` (not our schedule) and
    ``shm`` (no messages: its cost is memory bandwidth, see ``benchmarks/bench_shm.py``, not α–β)."""
    if algorithm in ("native", "shm"):
        return None
    if n == 1:
        return 0.0
    a, b, g, s = m.alpha, m.beta, m.gamma, float(nbytes)
    log_n = math.ceil(math.log2(n))
    key = (collective, algorithm)
    if key == ("broadcast", "naive"):
        return (n - 1) * (a + s * b)
    if key == ("broadcast", "tree"):
        return log_n * (a + s * b)
    if key == ("reduce", "naive"):
        return (n - 1) * (a + s * b + s * g)
    if key == ("reduce", "tree"):
        return log_n * (a + s * b + s * g)
    if key == ("all_reduce", "naive"):
        return 2 * (n - 1) * (a + s * b) + (n - 1) * s * g
    if key == ("all_reduce", "tree"):
        return 2 * log_n * (a + s * b) + log_n * s * g
    frac = (n - 1) / n
    pieces = ring_pieces(s, n, piece_bytes)
    if key == ("all_reduce", "ring"):
        return 2 * (n - 1) * pieces * a + 2 * frac * s * b + frac * s * g
    if key == ("all_reduce", "rhd"):
        p = 1 << (n.bit_length() - 1)
        pf = (p - 1) / p
        t = 2 * math.log2(p) * a + 2 * pf * s * b + pf * s * g
        return t + (2 * (a + s * b) + s * g if n != p else 0.0)
    if key == ("all_gather", "naive"):
        return 2 * (n - 1) * a + (n - 1) * (1 + 1 / n) * s * b
    if key == ("all_gather", "ring"):
        return (n - 1) * pieces * a + frac * s * b
    if key == ("reduce_scatter", "naive"):
        return 2 * (n - 1) * a + (n - 1) * (1 + 1 / n) * s * b + (n - 1) * s * g
    if key == ("reduce_scatter", "ring"):
        return (n - 1) * pieces * a + frac * s * b + frac * s * g
    raise ValueError(f"no cost model for {collective} with algorithm {algorithm!r}")
