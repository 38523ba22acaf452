"""Where the time of a profiled step goes, per rank, from a ``torch.profiler`` Chrome trace: pure functions.

One rank's trace (``RUN_DIR/profile/rank{r}.json``, the ``traceEvents`` of Chrome's trace format) becomes
per-step averages, in milliseconds:

- **step**: the ``ProfilerStep#N`` spans that ``torch.profiler`` puts around each scheduled step;
- **communication**: the union of the intervals of collective and point-to-point events, recognised by
  name (:func:`is_communication`): c10d's ops (``c10d::allreduce_``, ``c10d::send``), the backend's work
  (``gloo:all_reduce`` on Gloo's worker threads, ``nccl:all_reduce``), NCCL kernels (``ncclDevKernel_*``);
- **compute**: the union of the intervals of every other operator (CPU ops on any thread; on a GPU trace,
  every other kernel). An operator's time spent inside a communication op of its own thread (the enqueue
  of an all-reduce inside a gradient hook) counts as communication, not compute;
- **overlapped** communication: the part of the communication intervals during which compute runs (which
  can only be on another thread or stream); **exposed** communication: the rest, the communication time
  during which no compute runs, which is on the step's critical path;
- **data** and **optimizer**: the spans the trainer labels ``paratrain.data`` and ``paratrain.optimizer``
  (:meth:`paratrain.train.trainer.Trainer.train_step`); they overlap the compute above;
- **other**: step - compute - exposed communication: Python, idle waits, what no operator covers.

A CPU trace is analysed on the host timeline, inside the step spans. A trace that holds GPU kernels is
analysed on the device timeline (kernels only: the host runs ahead of the device). At world size 1 a
collective moves nothing (it is a local copy): its events count as neither communication nor compute.

References: Chrome's Trace Event Format (complete events, ``"ph": "X"``), ``torch.profiler``
(https://pytorch.org/docs/stable/profiler.html), and Holistic Trace Analysis's communication/computation
overlap (https://hta.readthedocs.io), whose "exposed communication" this follows.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from paratrain.tables import Col, table

Interval = tuple[float, float]
"""``(start, end)`` in microseconds, as the trace's ``ts`` and ``ts + dur``."""

STEP_PREFIX = "ProfilerStep#"
DATA, FORWARD_BACKWARD, OPTIMIZER = "paratrain.data", "paratrain.forward_backward", "paratrain.optimizer"
LABELS = (DATA, FORWARD_BACKWARD, OPTIMIZER)

_COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms", "c10d_functional::", "_c10d_functional::")
_COMM_WORDS = re.compile(r"all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all", re.IGNORECASE)
_NOT_COMPUTE = re.compile(r"wait|synchronize|^cuda[A-Z]|^cudnn|ProfilerStep#", re.IGNORECASE)
_GPU_CATS = ("kernel",)


def is_communication(name: str) -> bool:
    """Whether an event is a collective or a point-to-point transfer, by its name.

    ``c10d::*``, ``gloo:*``, ``nccl:*`` and NCCL kernels always are; the collective words (``allreduce``,
    ``all_gather``, ``reduce_scatter``, ``broadcast``, ``all_to_all``) count except in ATen operators
    (``aten::broadcast_tensors`` is arithmetic, not a transfer).
    """
    low = name.lower()
    if low.startswith(_COMM_PREFIXES) or "nccl" in low:
        return True
    return not low.startswith("aten::") and _COMM_WORDS.search(name) is not None


# ---- interval arithmetic ---------------------------------------------------------------------------------
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time (empty intervals dropped)."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def total(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The time in both ``a`` and ``b`` (each a :func:`union`)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The time in ``a`` and not in ``b`` (each a :func:`union`)."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


# ---- one rank ---------------------------------------------------------------------------------------------
def _events(trace: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    events = trace.get("traceEvents", []) if isinstance(trace, Mapping) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _span(e: Mapping[str, Any]) -> Interval:
    start = float(e["ts"])
    return start, start + float(e["dur"])


def step_number(name: str) -> int | None:
    """``"ProfilerStep#7"`` -> 7 (``None`` for any other name)."""
    if not name.startswith(STEP_PREFIX):
        return None
    tail = name[len(STEP_PREFIX) :]
    return int(tail) if tail.isdigit() else None


def summarize_rank(
    trace: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    world_size: int | None = None,
    steps: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Per-step averages (ms) of one rank's trace; see the module docstring for each definition.

    ``world_size`` defaults to the trace's ``distributedInfo`` (1 when absent): at 1, collectives are not
    communication. ``steps`` keeps only the ``ProfilerStep#N`` spans with N in that inclusive range (a run
    that stops inside the window leaves a last, partial span). Returns ``steps`` (how many step spans were
    used) and ``timeline`` (``cpu`` or ``gpu``).
    """
    if world_size is None:
        info = trace.get("distributedInfo") if isinstance(trace, Mapping) else None
        world_size = int(info.get("world_size", 1)) if isinstance(info, Mapping) else 1
    events = _events(trace)
    host = [e for e in events if not str(e.get("cat", "")).startswith("gpu_")]
    step_spans = [
        _span(e)
        for e in host
        if (number := step_number(str(e.get("name", "")))) is not None
        and (steps is None or steps[0] <= number <= steps[1])
    ]
    windows = union(step_spans)
    step_total = total(windows)
    n = len(step_spans)
    gpu = any(e.get("cat") in _GPU_CATS for e in events)
    if gpu:
        comm, compute = _device_timeline(events, world_size)
    else:
        comm, compute = _host_timeline(host, windows, world_size)
    overlapped = total(intersect(comm, compute))
    comm_time, compute_time = total(comm), total(compute)
    exposed = comm_time - overlapped

    def label(name: str) -> float:
        return _label_time(name, events, host, windows, gpu)

    per = 1e-3 / n if n else 0.0  # microseconds in total -> milliseconds per step
    return {
        "steps": n,
        "timeline": "gpu" if gpu else "cpu",
        "step_ms": step_total * per if n else None,
        "compute_ms": compute_time * per,
        "comm_ms": comm_time * per,
        "comm_exposed_ms": exposed * per,
        "comm_overlapped_ms": overlapped * per,
        "data_ms": label(DATA) * per,
        "forward_backward_ms": label(FORWARD_BACKWARD) * per,
        "optimizer_ms": label(OPTIMIZER) * per,
        "other_ms": max(0.0, step_total - compute_time - exposed) * per,
    }


def _device_timeline(
    events: list[Mapping[str, Any]], world_size: int
) -> tuple[list[Interval], list[Interval]]:
    """Communication and compute on the device timeline: kernels only."""
    comm_spans: list[Interval] = []
    compute_spans: list[Interval] = []
    for e in events:
        if e.get("cat") not in _GPU_CATS:
            continue
        if is_communication(str(e.get("name", ""))):
            if world_size > 1:
                comm_spans.append(_span(e))
        else:
            compute_spans.append(_span(e))
    return union(comm_spans), union(compute_spans)


def _host_timeline(
    host: list[Mapping[str, Any]], windows: list[Interval], world_size: int
) -> tuple[list[Interval], list[Interval]]:
    """Communication and compute on the host timeline, per thread, inside the step spans: an operator's
    time inside a communication op of its own thread counts as communication."""
    by_thread_comm: dict[Any, list[Interval]] = defaultdict(list)
    by_thread_ops: dict[Any, list[Interval]] = defaultdict(list)
    for e in host:
        name = str(e.get("name", ""))
        if name.startswith(STEP_PREFIX) or name in LABELS:
            continue
        thread = (e.get("pid"), e.get("tid"))
        if is_communication(name):
            by_thread_comm[thread].append(_span(e))
        elif e.get("cat") == "cpu_op" and not _NOT_COMPUTE.search(name):
            by_thread_ops[thread].append(_span(e))
    compute_spans: list[Interval] = []
    for thread, ops in by_thread_ops.items():
        compute_spans += subtract(union(ops), union(by_thread_comm.get(thread, [])))
    comm_spans: list[Interval] = []
    if world_size > 1:
        comm_spans = [s for spans in by_thread_comm.values() for s in spans]
    return intersect(union(comm_spans), windows), intersect(union(compute_spans), windows)


def _label_time(
    name: str,
    events: list[Mapping[str, Any]],
    host: list[Mapping[str, Any]],
    windows: list[Interval],
    gpu: bool,
) -> float:
    """Microseconds covered by the spans labelled ``name``: the device's annotation on a GPU trace (the
    host's where the device has none), the host's inside the step spans on a CPU trace."""
    cat = "gpu_user_annotation" if gpu else None
    spans = [_span(e) for e in events if e.get("name") == name and (cat is None or e.get("cat") == cat)]
    if not spans:  # no device span of the label (or a CPU trace): the host's
        spans = [_span(e) for e in host if e.get("name") == name]
    spans = union(spans) if gpu else intersect(union(spans), windows)
    return total(spans)


# ---- every rank -------------------------------------------------------------------------------------------
def summarize_ranks(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The cross-rank view of :func:`summarize_rank` results (each with a ``rank`` key): the slowest rank
    by step time, the median step time, and the slowest rank's gap to it (ms and percent)."""
    ranks = sorted((dict(r) for r in per_rank), key=lambda r: int(r["rank"]))
    timed = [r for r in ranks if r.get("step_ms") is not None]
    out: dict[str, Any] = {"ranks": ranks, "slowest_rank": None, "median_step_ms": None,
                           "slowest_gap_ms": None, "slowest_gap_pct": None}  # fmt: skip
    if timed:
        slowest = max(timed, key=lambda r: float(r["step_ms"]))
        median = statistics.median(float(r["step_ms"]) for r in timed)
        gap = float(slowest["step_ms"]) - median
        out.update(slowest_rank=int(slowest["rank"]), median_step_ms=median, slowest_gap_ms=gap,
                   slowest_gap_pct=100.0 * gap / median if median > 0 else None)  # fmt: skip
    return out


_COLUMNS = (
    ("step", "step_ms"),
    ("compute", "compute_ms"),
    ("comm", "comm_ms"),
    ("exposed", "comm_exposed_ms"),
    ("overlapped", "comm_overlapped_ms"),
    ("data", "data_ms"),
    ("optimizer", "optimizer_ms"),
    ("other", "other_ms"),
)


def format_table(summary: Mapping[str, Any]) -> str:
    """The per-rank table that rank 0 prints (milliseconds per step)."""
    steps = summary.get("profiled_steps") or []
    span = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
    head = (f"paratrain profile: {span} ({summary.get('timeline', 'cpu')} timeline), "
            "milliseconds per step, per rank")  # fmt: skip
    cols = [Col("rank", ">", 4)] + [Col(title, ">", 10) for title, _ in _COLUMNS]
    rows = [
        [str(r["rank"])] + [f"{r[key]:.2f}" if r.get(key) is not None else "-" for _, key in _COLUMNS]
        for r in summary.get("ranks", [])
    ]
    lines = [head, *table(cols, rows)]
    if summary.get("slowest_rank") is not None:
        slow = next(r for r in summary["ranks"] if r["rank"] == summary["slowest_rank"])
        pct = summary.get("slowest_gap_pct")
        lines.append(
            f"slowest rank: {summary['slowest_rank']} ({slow['step_ms']:.2f} ms/step), "
            f"{summary['slowest_gap_ms']:+.2f} ms"
            + (f" ({pct:+.1f}%)" if pct is not None else "")
            + f" against the median {summary['median_step_ms']:.2f} ms"
        )
    lines.append("exposed = communication while no compute runs (on the critical path); "
                 "overlapped = communication hidden under compute")  # fmt: skip
    return "\n".join(lines)
