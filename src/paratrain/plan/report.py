"""Text tables and plots of a plan / recommendation / sweep result (the dicts of :mod:`paratrain.plan.api`)."""

from __future__ import annotations

from typing import Any

from paratrain.plan.time import ATTENTION_RELATIVE
from paratrain.tables import Col, table

COMPONENTS = ("params", "grads", "optimizer", "activations", "buffers")
TIMES = ("compute", "bubble", "exposed_comm")


def _gb(x: float, scale: float = 1e9) -> str:
    return f"{x / scale:,.2f}" if x < 10 * scale else f"{x / scale:,.0f}"


def _unit(plans: list[dict[str, Any]]) -> tuple[float, str]:
    """GB (1e9) for GPU-sized models, MB (1e6) or KB (1e3) for small ones."""
    top = max((p["bytes_per_rank"]["peak"] for p in plans), default=0)
    return next(((s, u) for s, u in ((1e9, "GB"), (1e6, "MB")) if top >= s), (1e3, "KB"))


def _ac(p: dict[str, Any]) -> str:
    ac = p["activation_checkpointing"]
    return "full" if ac is True else "none" if ac is False else str(ac)


def _layout(p: dict[str, Any]) -> str:
    lay = p["layout"]
    return f"{lay['dp_replicate']}x{lay['dp_shard']}x{lay['tp']}x{lay['pp']}"


def _title(result: dict[str, Any]) -> str:
    c = result["cluster"]
    nodes = max(1, -(-c["gpus"] // c["gpus_per_node"]))
    return (
        f"paratrain plan: {result['model']} ({result['num_params']:,} parameters) on {c['gpus']} GPUs "
        f"({nodes} node{'s' if nodes > 1 else ''} of {c['gpus_per_node']}; {c['name']}: {_gb(c['gpu_mem_bytes'])} GB, "
        f"{c['gpu_flops'] / 1e12:,.4g} TFLOP/s x {c['efficiency']:g}{_knee(c)}); {result['precision']}, "
        f"{result['optimizer']}"
    )


def _knee(c: dict[str, Any]) -> str:
    knee = c.get("matmul_knee") or 0
    return f" for wide matmuls, half at width {knee:g}, attention x {ATTENTION_RELATIVE:g}" if knee else ""


def format_plans(result: dict[str, Any]) -> str:
    """One row per plan: bytes per rank by component (GB = 1e9), fits, comm per step, step time, MFU."""
    lines = [_title(result)]
    plans = result["plans"]
    scale, unit = _unit(plans)
    if plans:
        p0 = plans[0]
        lines.append(f"global batch {p0['global_batch_size']} x {p0['seq_len']} tokens; layout = dp_replicate x "
                     f"dp_shard x tp x pp; bytes per rank in {unit} ({scale:.0e}); comm = bytes sent per rank per step")  # fmt: skip
    cols = [Col("strategy", width=11), Col("layout", width=12), Col("AC", width=9)]
    cols += [Col(k, ">", 8) for k in ("params", "grads", "optim", "activ", "buffers", "peak")]
    cols += [Col("fits", width=4), Col("comm " + unit, ">", 8), Col("step s", ">", 9), Col("MFU", ">", 5)]
    rows = []
    for p in plans:
        b = p["bytes_per_rank"]
        mfu = f"{100 * p['mfu']:.0f}%" if p.get("mfu") is not None else "-"
        rows.append([p["strategy"], _layout(p), _ac(p), *(_gb(b[k], scale) for k in (*COMPONENTS, "peak")),
                     "yes" if p["fits"] else "NO", _gb(p["comm_bytes_per_rank_per_step"]["total"], scale),
                     f"{p['step_time_s']:.4g}", mfu])  # fmt: skip
    lines += ["", *table(cols, rows)]
    for p in plans:
        for a in p.get("advice", []):
            lines.append(f"{p['strategy']} does not fit; it {a}")
    if "rejected" in result:
        lines += ["", f"evaluated {result['evaluated']} layouts, {result['fitting']} fit. Chosen:"]
        lines += [f"  {p['reason']}" for p in plans] or ["  none fits: see below"]
        lines += ["Rejected:"] + [f"  {r['reason']}" for r in result["rejected"]]
    return "\n".join(lines)


def format_sweep(result: dict[str, Any]) -> str:
    """One row per GPU count: the best layout, its step time, throughput, MFU and scaling efficiency."""
    cols = [Col("GPUs", ">", 6), Col("best layout", width=34, gap=2), Col("step s", ">", 9),
            Col("tokens/s", ">", 12), Col("MFU", ">", 5), Col("scaling", ">", 8)]  # fmt: skip
    rows = []
    for row in result["sweep"]:
        p = row["plan"]
        if p is None:
            rows.append([str(row["gpus"]), "nothing fits"])
            continue
        label = f"{p['strategy']} {_layout(p)}{'' if _ac(p) == 'none' else ' AC ' + _ac(p)}"
        rows.append([str(row["gpus"]), label, f"{row['step_time_s']:.4g}", f"{row['tokens_per_s']:.4g}",
                     f"{100 * (row['mfu'] or 0):.0f}%", f"{100 * row['scaling_efficiency']:.0f}%"])  # fmt: skip
    return "\n".join([_title(result), "", *table(cols, rows)])


def plot(result: dict[str, Any], path: str) -> None:
    """Plans: stacked bars of bytes per rank by component (the GPU's memory as a line) and of the step time
    (compute, bubble, exposed communication). Sweep: step time and scaling efficiency against GPUs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    if "sweep" in result:
        rows = [r for r in result["sweep"] if r["plan"] is not None]
        xs = [r["gpus"] for r in rows]
        left.plot(xs, [r["step_time_s"] for r in rows], marker="o")
        left.set(
            xscale="log",
            xlabel="GPUs",
            ylabel="step time (s)",
            title=f"{result['model']}: best layout per GPU count",
        )
        right.plot(xs, [100 * r["scaling_efficiency"] for r in rows], marker="o", label="scaling efficiency")
        right.plot(xs, [100 * (r["mfu"] or 0) for r in rows], marker="s", label="MFU")
        right.set(xscale="log", xlabel="GPUs", ylabel="%", title="efficiency")
        right.legend()
    else:
        plans = result["plans"]
        labels = [
            f"{p['strategy']}\n{_layout(p)}{'' if _ac(p) == 'none' else ' AC ' + _ac(p)}" for p in plans
        ]
        xs = list(range(len(plans)))
        bottom = [0.0] * len(plans)
        for k in COMPONENTS:
            vals = [p["bytes_per_rank"][k] / 1e9 for p in plans]
            left.bar(xs, vals, bottom=bottom, label=k)
            bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
        left.axhline(result["cluster"]["gpu_mem_bytes"] / 1e9, color="k", linestyle="--", label="GPU memory")
        left.set(ylabel="GB per rank (1e9)", title=f"{result['model']}: memory per rank")
        bottom = [0.0] * len(plans)
        for k in TIMES:
            vals = [p["time_s"][k] for p in plans]
            right.bar(xs, vals, bottom=bottom, label=k.replace("_", " "))
            bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
        right.set(ylabel="seconds per step", title="step time")
        for ax in (left, right):
            ax.set_xticks(xs, labels, rotation=45, ha="right", fontsize=8)
            ax.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
