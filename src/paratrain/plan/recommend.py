"""Search the layouts of a GPU count, rank those that fit by step time, and say why for each one.

The candidates are every (dp_replicate, dp_shard, tp, pp, activation checkpointing) with

- tp ≤ gpus_per_node (TP's per-layer collectives are on the critical path: they belong on NVLink), tp
  dividing the heads and the KV heads;
- pp ≤ the layers; tp × pp dividing the GPUs; the rest data parallel: ``ddp``, ``zero1``, ``zero2``,
  ``zero3`` or ``hsdp`` (every dp_shard that divides it) without tp/pp, FSDP (``fsdp+tp``, ``fsdp+pp``,
  ``fsdp+tp+pp``, with every dp_shard × dp_replicate split) with them.

Pruning keeps thousands of GPUs under a second: a layout whose model states alone exceed the GPU is
rejected before its activations are computed; activation checkpointing (which only adds compute) is tried
only for a layout that does not fit without it; pipeline stages are evaluated only where they can be
worst (first, last, most layers). Each evaluation is a few dozen arithmetic operations per stage.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from paratrain.errors import ConfigError
from paratrain.plan import layout as lay
from paratrain.plan import memory as mem
from paratrain.plan.api import Workload, evaluate, header, stages
from paratrain.plan.layout import Layout
from paratrain.plan.model import ModelSpec
from paratrain.spec.hardware import Cluster


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def candidates(spec: ModelSpec, cluster: Cluster) -> list[tuple[str, str, Layout]]:
    """Every valid (strategy, sharding, layout) for ``cluster.gpus`` GPUs."""
    g, out = cluster.gpus, []
    sh = spec.shape
    tps = [t for t in lay.valid_tp(sh, min(cluster.gpus_per_node, g)) if g % t == 0]
    if (
        spec.moe is not None or "tp" not in spec.splits
    ):  # MoE: ep splits the experts; an HF arch without a plan
        tps = [1]
    for t in tps:
        pps = [p for p in _divisors(g // t) if sh is not None and p <= sh.n_layers] if sh else [1]
        if "pp" not in spec.splits:
            pps = [1]
        for p in pps:
            dp = g // (t * p)
            if t == 1 and p == 1:
                out += [("ddp", "none", Layout.of(dp_replicate=dp))]
                out += [
                    (s, lay.STRATEGIES[s].sharding, Layout.of(dp_shard=dp))
                    for s in ("zero1", "zero2", "zero3")
                ]
                out += [
                    ("hsdp", "full", Layout.of(dp_replicate=dp // s, dp_shard=s)) for s in _divisors(dp)[1:-1]
                ]
                continue
            for s in _divisors(dp):
                layout = Layout.of(dp_replicate=dp // s, dp_shard=s, tp=t, pp=p)
                if dp > 1 and s == 1:
                    continue  # replicas without sharding: FSDP over the same ranks holds less for the same traffic
                name = lay.name_for(layout)
                out.append((name, "full" if dp > 1 else lay.STRATEGIES[name].sharding, layout))
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:,.0f}" if x >= 10e9 else f"{x / 1e9:,.1f}"


def _states_floor(spec: ModelSpec, sharding: str, layout: Layout, w: Workload) -> float:
    """Model-state bytes of the busiest rank (the largest pipeline stage): a lower bound of its peak."""
    d = mem.dtypes(w.precision, w.optimizer, w.momentum)
    t = layout.tp
    psi = max(
        sum(g.per_rank(t) for g in groups)
        + (spec.first.per_rank(t) if first else 0.0)
        + (spec.last.per_rank(t) if last else 0.0)
        for _, groups, first, last in stages(spec, layout.pp)
    )
    return 0.0 if w.offload else mem.model_states(psi, layout.dp_shard, sharding, d).total


AC_TRIED = ("none", "selective", "full")
SCHEDULES_TRIED = ("1f1b", "interleaved-1f1b")
"""Pipeline schedules ``--recommend`` tries for a pipelined layout; it keeps the faster one that fits
(interleaving shrinks the bubble v times and holds up to 1.5x the activations on the first rank)."""
"""Activation checkpointing ``--recommend`` tries for each layout, cheapest recomputation first."""


def _label(name: str, layout: Layout, ac: str | bool, schedule: str | None = None) -> str:
    shown = {k: v for k, v in layout.to_dict().items() if v > 1} or {"gpus": 1}
    degrees = " ".join(f"{k}={v}" for k, v in shown.items())
    ac = "full" if ac is True else "none" if ac is False else ac
    return f"{name} ({degrees}{f', {schedule}' if schedule else ''}{'' if ac == 'none' else f', AC {ac}'})"


def _rejection(name: str, layout: Layout, ac: str, needs: float, reason: str) -> dict[str, Any]:
    return {"strategy": name, "layout": layout.to_dict(), "activation_checkpointing": ac, "needs": needs,
            "reason": reason}  # fmt: skip


def _best_of_layout(
    spec: ModelSpec,
    cluster: Cluster,
    w: Workload,
    name: str,
    sharding: str,
    layout: Layout,
    rejected: list[dict[str, Any]],
) -> tuple[dict[str, Any] | None, int]:
    """``(the fastest plan of one layout that fits or None, plans evaluated)``: checkpointing tried cheapest
    first until one fits, then, for a pipeline, the other schedules at that checkpointing; what does not fit
    is appended to ``rejected``."""  # fmt: skip
    mem_cap = cluster.gpu_mem_bytes
    best: dict[str, Any] | None = None
    evaluated = 0
    ws = replace(w, pp_schedule=SCHEDULES_TRIED[0]) if layout.pp > 1 else w
    for ac in AC_TRIED if not spec.states_only else ("none",):
        try:
            p = evaluate(spec, name, sharding, layout, replace(ws, activation_checkpointing=ac), cluster)
        except ConfigError as e:
            rejected.append(_rejection(name, layout, ac, 0.0, f"{_label(name, layout, ac)}: {e}"))
            break
        evaluated += 1
        if p["fits"]:
            best = p
            break
        b = p["bytes_per_rank"]
        states = b["params"] + b["grads"] + b["optimizer"]
        p["reason"] = (
            f"{_label(name, layout, ac)}: needs {_gb(b['peak'])} GB per GPU at peak (states {_gb(states)} + "
            f"activations {_gb(b['activations'])} + buffers {_gb(b['buffers'])}), has {_gb(mem_cap)}"
        )
        if ac == AC_TRIED[-1] or spec.states_only:
            rejected.append(_rejection(name, layout, ac, float(b["peak"]), p["reason"]))
    if best is not None and layout.pp > 1:
        # interleaving holds more activations than 1F1B: it can only fit where 1F1B does, so it is tried
        # once, at the checkpointing 1F1B first fits with, and kept when it fits and is faster
        for schedule in SCHEDULES_TRIED[1:]:
            try:
                p = evaluate(spec, name, sharding, layout, replace(ws, pp_schedule=schedule,
                             activation_checkpointing=best["activation_checkpointing"]), cluster)  # fmt: skip
            except ConfigError:
                continue  # micro-batches that do not split into rounds of pp
            evaluated += 1
            if p["fits"] and p["step_time_s"] < best["step_time_s"]:
                best = p
    return best, evaluated


def _rank(fitting: list[dict[str, Any]], mem_cap: float) -> None:
    """Sort the fitting plans fastest first (near-ties, within 0.1%, to the lower peak: the most headroom)
    and write each one's ``reason``."""
    fitting.sort(key=lambda p: (float(f"{p['step_time_s']:.3g}"), p["bytes_per_rank"]["peak"]))
    for rank, p in enumerate(fitting):
        label = _label(
            p["strategy"], Layout.of(**p["layout"]), p["activation_checkpointing"], p.get("pp_schedule")
        )
        head = "fastest" if rank == 0 else f"{p['step_time_s'] / fitting[0]['step_time_s']:.2f}x the fastest"
        exposed = p["time_s"]["exposed_comm"] + p["time_s"]["bubble"]
        p["reason"] = (
            f"{label}: {head}; step {p['step_time_s']:.3g} s (compute {p['time_s']['compute']:.3g} s, bubble + "
            f"exposed comm {exposed:.3g} s), MFU {100 * (p['mfu'] or 0):.0f}%, peak {_gb(p['bytes_per_rank']['peak'])} "
            f"of {_gb(mem_cap)} GB"
        )


def _shown_rejections(rejected: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """The pure data-parallel rejections always, then the others that came closest, up to ``top``."""
    dp_names = set(lay.DATA_PARALLEL)
    shown = [r for r in rejected if r["strategy"] in dp_names and r["layout"]["tp"] == r["layout"]["pp"] == 1]
    others = sorted((r for r in rejected if r not in shown), key=lambda r: r["needs"])[
        : max(0, top - len(shown))
    ]
    return [{k: v for k, v in r.items() if k != "needs"} for r in shown + others]


def recommend(
    spec: ModelSpec, cluster: Cluster, workload: Workload | None = None, top: int = 5
) -> dict[str, Any]:
    """The JSON of ``paratrain plan --recommend``: ``plans`` holds the ``top`` fastest layouts that fit (each
    with its ``reason``), ``rejected`` the others that were considered, with theirs; ``evaluated`` and
    ``fitting`` count them. The pure data-parallel strategies always appear, in one list or the other."""
    w = workload or Workload()
    if w.activation_checkpointing != "none":
        w = replace(w, activation_checkpointing="none")  # every mode is tried; AC only where needed
    mem_cap = cluster.gpu_mem_bytes
    fitting: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    evaluated = 0
    for name, sharding, layout in candidates(spec, cluster):
        if w.offload and sharding != "full":
            continue
        floor = _states_floor(spec, sharding, layout, w)
        if floor > mem_cap:
            rejected.append(_rejection(name, layout, "none", floor, f"{_label(name, layout, 'none')}: needs "
                                       f"{_gb(floor)} GB per GPU for model states alone, has {_gb(mem_cap)}"))  # fmt: skip
            continue
        best, n = _best_of_layout(spec, cluster, w, name, sharding, layout, rejected)
        evaluated += n
        if best is not None:
            fitting.append(best)
    for p in _expert_parallel(spec, cluster, w):  # an MoE model: ep and fsdp+ep at every degree that applies
        evaluated += 1
        if p["fits"]:
            fitting.append(p)
        else:
            b = p["bytes_per_rank"]
            rejected.append({"strategy": p["strategy"], "layout": p["layout"], "needs": float(b["peak"]),
                             "activation_checkpointing": p["activation_checkpointing"],
                             "reason": f"{p['strategy']} ep={p['layout']['ep']}: needs {_gb(b['peak'])} GB per GPU "
                             f"at peak, has {_gb(mem_cap)}"})  # fmt: skip
    _rank(fitting, mem_cap)
    out = header(spec, cluster, w)
    out.update(plans=fitting[:top], rejected=_shown_rejections(rejected, top), evaluated=evaluated,
               fitting=len(fitting))  # fmt: skip
    return out


def _expert_parallel(spec: ModelSpec, cluster: Cluster, w: Workload) -> list[dict[str, Any]]:
    """The plans of ``ep`` and ``fsdp+ep`` at every ep degree that divides the GPUs and the experts (without,
    then with activation checkpointing where the first does not fit); none for a dense model."""
    from paratrain.plan.api import ep_plans
    from paratrain.plan.moe import EP_STRATEGIES

    moe = spec.moe
    if moe is None or cluster.gpus < 2 or "ep" not in spec.splits:
        return []
    out = []
    for name in EP_STRATEGIES:
        if w.offload and name == "ep":
            continue
        for ep in (d for d in _divisors(cluster.gpus) if d > 1 and moe.n_experts % d == 0):
            for ac in (False, True):
                try:
                    p = ep_plans(spec, cluster, replace(w, activation_checkpointing=ac), name, ep, 1.0)[0]
                except ConfigError:
                    break
                out.append(p)
                if p["fits"]:
                    break
    return out


def sweep(
    spec: ModelSpec, cluster: Cluster, gpus: list[int], workload: Workload | None = None
) -> dict[str, Any]:
    """For each GPU count, the fastest layout that fits, its step time, throughput and MFU, and the scaling
    efficiency: throughput per GPU relative to the smallest count that has a fitting layout."""
    w = workload or Workload()
    rows: list[dict[str, Any]] = []
    base: float | None = None
    for g in gpus:
        c = cluster.with_gpus(g)
        if g > c.gpus_per_node and g % c.gpus_per_node:
            raise ConfigError(f"--sweep-gpus: {g} GPUs do not fill whole nodes of {c.gpus_per_node}.")
        best = recommend(spec, c, w, top=1)["plans"]
        row: dict[str, Any] = {"gpus": g, "plan": best[0] if best else None}
        if best:
            p = best[0]
            per_gpu = p["global_batch_size"] * p["seq_len"] / p["step_time_s"] / g
            base = base or per_gpu
            row.update(step_time_s=p["step_time_s"], mfu=p["mfu"], samples_per_s=p["global_batch_size"] / p["step_time_s"],
                       tokens_per_s=per_gpu * g, scaling_efficiency=per_gpu / base)  # fmt: skip
        rows.append(row)
    out = header(spec, cluster, w)
    out["sweep"] = rows
    return out
