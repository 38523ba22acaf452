"""Fit the planner's width model: the matmul knee and attention's relative efficiency.

With the width model on (``paratrain plan --matmul-knee K``), the calibrated efficiency is a *wide* matmul's,
a matmul whose narrowest side on the rank is ``w`` runs at ``w / (w + K)`` of it and attention's products at
``A`` of it (:func:`paratrain.plan.time.compute_slowdown`). If the model describes the GPUs, the wide-matmul
efficiency a published run implies no longer depends on its model's width, its tensor-parallel degree or its
sequence length, only on the GPU and the code: the rows of one group (a GPU family and compute of the project's
table, or one of MosaicML's two MPT tables) imply the same efficiency.

For each candidate ``(K, A)`` every row is planned once at efficiency 0.5 and its implied efficiency solved
from the published step time: ``e = 0.5 · compute / ((published − exposed communication) / (1 + bubble))`` (the
exposed communication taken from that plan: the bisection of ``bench_plan_published.py`` would move it
slightly). The score is the pooled standard deviation of log(implied efficiency) within the groups; the
candidate with the smallest wins and is what :data:`paratrain.spec.hardware.MATMUL_KNEE` and
:data:`paratrain.plan.time.ATTENTION_RELATIVE` hold (``check_claims`` compares). Rows: the fitted rows of
``bench_plan_published.py`` (never its held-out ones) and all 113 of ``bench_plan_mpt.py``.

    python benchmarks/fit_matmul_knee.py [--json benchmarks/results/plan_knee_fit.json] [--plot FILE.png]

Pure computation; a few minutes on one core.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from paratrain.plan import time as plan_time
from paratrain.spec import hardware as cl

KNEES = (0.0, 200.0, 400.0, 600.0, 800.0, 1000.0, 1200.0, 1600.0)
ATTENTION = (1.0, 0.8, 0.7, 0.6, 0.5)
BASE = 0.5


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows() -> list[dict[str, Any]]:
    """``{"name", "group", "argv", "published"}`` for every row the fit uses."""
    published, mpt = _module("bench_plan_published"), _module("bench_plan_mpt")
    out = [{"name": r["name"], "group": r["family"], "argv": r["argv"],
            "published": {k: r[k] for k in ("tokens_per_s_per_gpu", "step_s") if k in r}}
           for r in published.ROWS if ("tokens_per_s_per_gpu" in r or "step_s" in r) and not r.get("held_out_only")]  # fmt: skip
    out += [{"name": r["name"], "group": f"{r['gpu']} MPT", "argv": r["argv"],
             "published": {"tokens_per_s_per_gpu": r["published"]["tokens_per_s_per_gpu"]}} for r in mpt.rows()]  # fmt: skip
    return out


def implied(plan: dict[str, Any], published: dict[str, float]) -> float:
    """The efficiency at which ``plan`` (planned at :data:`BASE`) takes the published step time (``step_s``, or
    from ``tokens_per_s_per_gpu``)."""
    step = published.get("step_s") or plan["global_batch_size"] * plan["seq_len"] / (
        published["tokens_per_s_per_gpu"] * plan["gpus"]
    )
    t = plan["time_s"]
    bubble = t["bubble"] / t["compute"] if t["compute"] else 0.0
    return BASE * t["compute"] / ((step - t["exposed_comm"]) / (1 + bubble))


def score(effs: dict[str, list[float]]) -> float:
    """Pooled standard deviation of log(efficiency) within the groups."""
    sq = sum(statistics.pvariance([math.log(e) for e in v]) * len(v) for v in effs.values() if len(v) > 1)
    n = sum(len(v) for v in effs.values() if len(v) > 1)
    return math.sqrt(sq / n)


def _dim(argv: list[str]) -> int:
    """The hidden size of a row's model (its preset, reshaped by ``--set model.dim=``)."""
    from paratrain.plan.cli import add_arguments, model_spec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shape = model_spec(parser.parse_args(argv)).shape
    assert shape is not None
    return shape.dim


def plot(result: dict[str, Any], path: str) -> None:
    """Each row's implied efficiency over its group's geometric mean against the model's width per rank (dim /
    tp), without the width model and at the best pair: the trend the model takes out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = result["best"]
    panels = [("one efficiency per GPU and compute", next(g for g in result["grid"] if g["knee"] == 0)),
              (f"width model: knee {b['knee']:g}, attention x {b['attention_relative']:g}",
               next(g for g in result["grid"] if (g["knee"], g["attention_relative"]) == (b["knee"], b["attention_relative"])))]  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    groups = sorted({r["group"] for r in result["rows"]})
    for ax, (title, g) in zip(axes, panels, strict=True):
        for group in groups:
            idx = [i for i, r in enumerate(result["rows"]) if r["group"] == group]
            xs = [result["rows"][i]["dim_per_rank"] for i in idx]
            ys = [g["implied"][i] / g["groups"][group]["geomean"] for i in idx]
            ax.scatter(xs, ys, s=14, label=group, alpha=0.75)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(
            xscale="log", xlabel="model width per rank (dim / tp)", title=f"{title}\nlog-std {g['score']:.3f}"
        )
    axes[0].set_ylabel("implied efficiency / group's geometric mean")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(groups))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


def run() -> dict[str, Any]:
    plan = _module("bench_plan_published")._plan
    table = rows()
    widths = [_dim(r["argv"]) / plan(r["argv"], BASE, 0.0)["layout"]["tp"] for r in table]
    grid = []
    kept = plan_time.ATTENTION_RELATIVE
    try:
        for knee in KNEES:
            for attention in ATTENTION if knee else (1.0,):
                plan_time.ATTENTION_RELATIVE = attention
                effs: dict[str, list[float]] = {}
                per_row = []
                for r in table:
                    p = plan(r["argv"], BASE, knee)
                    per_row.append(implied(p, r["published"]))
                    effs.setdefault(r["group"], []).append(per_row[-1])
                grid.append({"knee": knee, "attention_relative": attention, "score": score(effs), "implied": per_row,
                             "groups": {g: {"geomean": math.exp(statistics.fmean(math.log(e) for e in v)),
                                            "log_std": statistics.pstdev(math.log(e) for e in v),
                                            "min": min(v), "max": max(v), "rows": len(v)}
                                        for g, v in effs.items()}})  # fmt: skip
    finally:
        plan_time.ATTENTION_RELATIVE = kept
    best = min(grid, key=lambda g: g["score"])
    off = next(g for g in grid if g["knee"] == 0)
    return {
        "benchmark": "fit_matmul_knee",
        "conditions": {
            "host": platform.node(),
            "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_avg_start": os.getloadavg(),
            "note": "pure computation; load does not change the figures",
        },
        "rows": [
            {"name": r["name"], "group": r["group"], "dim_per_rank": w}
            for r, w in zip(table, widths, strict=True)
        ],
        "grid": grid,
        "best": {
            "knee": best["knee"],
            "attention_relative": best["attention_relative"],
            "score": best["score"],
        },
        "without_width_model": {"score": off["score"]},
        "in_use": {"knee": cl.MATMUL_KNEE, "attention_relative": kept},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/plan_knee_fit.json")
    ap.add_argument(
        "--plot", metavar="PNG", help="implied efficiency against width, without and with the model"
    )
    args = ap.parse_args()
    result = run()
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    b, off = result["best"], result["without_width_model"]
    print(f"{len(result['rows'])} rows; within-group spread of log(implied efficiency): {off['score']:.3f} without the "
          f"width model, {b['score']:.3f} at knee {b['knee']:g}, attention x {b['attention_relative']:g}")  # fmt: skip
    best = next(
        g
        for g in result["grid"]
        if g["knee"] == b["knee"] and g["attention_relative"] == b["attention_relative"]
    )
    for group, s in best["groups"].items():
        print(
            f"  {group}: {s['rows']} rows, implied {s['min']:.3f}-{s['max']:.3f} (geomean {s['geomean']:.3f})"
        )
    use = result["in_use"]
    if (use["knee"], use["attention_relative"]) != (b["knee"], b["attention_relative"]):
        print(
            f"the planner uses knee {use['knee']:g}, attention x {use['attention_relative']:g}: not the best fit"
        )


if __name__ == "__main__":
    main()
