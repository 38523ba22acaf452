"""``--cpu-bind cores``: every worker pinned to its own block of the launcher's CPU cores.

Without binding the kernel may run two ranks on one core while another core idles, and move a rank from
core to core between collectives; on a CPU job whose ranks wait for each other at every collective, the
slowest placement sets the pace. MPI launchers bind by default (``mpirun --bind-to core``,
``srun --cpu-bind=cores``); torchrun binds only GPU workers (``--numa-binding``).

- :func:`core_blocks` splits the cores this launcher may use (``os.sched_getaffinity``, so a Slurm cpuset
  or ``taskset`` around the launcher holds) into one equal block per local rank, in order. Cores left over
  from an uneven split stay unused: synchronous ranks go at the pace of the slowest, so unequal blocks
  would only idle the larger ones. With more ranks than cores, local rank r gets core ``r mod cores``.
- The agent starts every worker through :mod:`boot` (``python -S boot.py ENTRY...``), which pins itself
  to its block (``LOCAL_RANK``'s entry of ``PARATRAIN_CPU_BLOCKS``, :func:`pin`) and then replaces itself
  with the real worker (``os.execv``). The pid stays the one the elastic agent watches, and the binding is
  in place before the worker's interpreter starts, so every thread it makes (OpenMP's, Gloo's) inherits it.

This file imports only the standard library, none of it named like a file of this directory: :mod:`boot`,
run as a script, imports it by its bare name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

BLOCKS_ENV = "PARATRAIN_CPU_BLOCKS"
CHOICES = ("none", "cores")


def supported() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def allowed_cores() -> list[int]:
    """The cores this process may run on, in order (all of them where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def core_blocks(cores: Sequence[int], nproc: int) -> list[list[int]]:
    """One block of cores per local rank: ``len(cores) // nproc`` consecutive cores each, or with more
    ranks than cores one core each, round robin."""
    if nproc < 1 or not cores:
        raise ValueError(f"core_blocks needs at least one rank and one core, got {nproc} and {list(cores)}")
    cores = list(cores)
    if nproc > len(cores):
        return [[cores[r % len(cores)]] for r in range(nproc)]
    k = len(cores) // nproc
    return [cores[r * k : (r + 1) * k] for r in range(nproc)]


def encode(blocks: Sequence[Sequence[int]]) -> str:
    return ";".join(",".join(str(c) for c in block) for block in blocks)


def decode(text: str) -> list[list[int]]:
    return [[int(c) for c in block.split(",")] for block in text.split(";")]


def _span(block: Sequence[int]) -> str:
    if len(block) > 1 and list(block) == list(range(block[0], block[-1] + 1)):
        return f"cores {block[0]}-{block[-1]}"
    return ("core " if len(block) == 1 else "cores ") + ",".join(str(c) for c in block)


def describe(blocks: Sequence[Sequence[int]], cores: Sequence[int]) -> str:
    """One line for the launcher's log: which local rank runs where, and what is left unused or shared."""
    parts = [f"local rank {r} on {_span(b)}" for r, b in enumerate(blocks)]
    used = {c for b in blocks for c in b}
    line = f"--cpu-bind cores: {', '.join(parts)}"
    if len(blocks) > len(cores):
        line += f" ({len(blocks)} ranks share {len(cores)} core(s))"
    elif len(used) < len(cores):
        line += f" ({len(cores) - len(used)} of {len(cores)} core(s) unused: they do not split evenly)"
    return line


def pin(blocks: Sequence[Sequence[int]], local_rank: int) -> None:
    """Pin this process to ``blocks[local_rank]``."""
    if not 0 <= local_rank < len(blocks):
        raise SystemExit(
            f"paratrain cpu_bind: LOCAL_RANK={local_rank} but {BLOCKS_ENV} has {len(blocks)} blocks"
        )
    os.sched_setaffinity(0, blocks[local_rank])
