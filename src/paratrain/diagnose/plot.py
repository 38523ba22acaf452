"""``paratrain plot RUN_DIR... [-o out.png]``: one picture of one or several runs.

    paratrain plot runs/ddp runs/zero3 runs/fsdp+tp -o compare.png
    paratrain plot runs/ddp --json

Four panels, drawn with matplotlib (Agg) into one PNG:

1. the loss curves (``metrics.jsonl``, one record per logging step) of every run on the same axes, so that
   strategies which should agree can be seen to overlap;
2. the throughput of every logging interval (``samples_per_s`` of the same records);
3. the memory per rank of each run (``summary.json``: ``model_state_bytes_per_rank`` at rest and
   ``peak_bytes_per_rank`` during a step, each the largest over the run's ranks);
4. from ``--profile`` (``profile/summary.json``), a stacked bar per rank of compute, exposed communication
   and other time per step (overlapped communication is hidden under compute, so it adds no height).

A mixture-of-experts run (``moe`` in its records) adds a third row: the expert load over the steps (the busiest
expert's tokens over the mean, the largest over the MoE layers) and, of the first such run, the tokens each
expert of each MoE layer received in the last logged step.

A panel with nothing to show says what would fill it. ``--json`` prints the numbers drawn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

_MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``paratrain plot``."""
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each has metrics.jsonl)"
    )
    parser.add_argument(
        "-o", "--output", default="paratrain-plot.png", help="PNG to write (default %(default)s)"
    )
    parser.add_argument(
        "--size", default="1400x1000", metavar="WxH", help="picture size in pixels (default %(default)s)"
    )
    parser.add_argument("--title", default=None, help="a title above the panels")
    parser.add_argument(
        "--json", action="store_true", help="also print the numbers drawn, as one JSON object"
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """Everything ``plot`` draws of one run directory. Raises :class:`ConfigError` if it is not one."""
    d = Path(run_dir)
    metrics_path = d / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ConfigError(
            f"{str(d)!r} has no metrics.jsonl: give the run directory of a paratrain train run "
            "(--run-dir, or runs/<time>-<strategy>)."
        )
    records = []
    # undecodable bytes (a damaged file) spoil their line only, as a line cut short by a crash does
    for line in metrics_path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short by a crash
            continue
    steps = _superseded_dropped([r for r in records if "loss" in r])
    summary = _read_json(d / "summary.json") or {}
    config = _read_json(d / "config.json") or {}
    strategy = summary.get("strategy") or config.get("strategy", {}).get("name") or "?"
    world = summary.get("world_size")
    return {
        "run_dir": str(d),
        "label": f"{strategy} x{world}" if world else f"{strategy} ({d.name})",
        "step": [r["step"] for r in steps],
        "loss": [r["loss"] for r in steps],
        "throughput_step": [r["step"] for r in steps if r.get("samples_per_s")],
        "samples_per_s": [r["samples_per_s"] for r in steps if r.get("samples_per_s")],
        "model_state_bytes_per_rank": summary.get("model_state_bytes_per_rank"),
        "peak_bytes_per_rank": summary.get("peak_bytes_per_rank"),
        "profile": _read_json(d / "profile" / "summary.json"),
        "moe_step": [r["step"] for r in steps if isinstance(r.get("moe"), dict)],
        "moe_overload": [r["moe"].get("overload") for r in steps if isinstance(r.get("moe"), dict)],
        "moe_tokens_per_expert": next(
            (r["moe"].get("tokens_per_expert") for r in reversed(steps) if isinstance(r.get("moe"), dict)),
            None,
        ),
    }


def _superseded_dropped(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A resumed launch logs again the steps after its checkpoint that a crashed launch had logged: a step
    that goes back replaces what was logged from that step on, so each step is drawn once."""
    out: list[dict[str, Any]] = []
    for r in steps:
        while out and isinstance(r.get("step"), int) and out[-1].get("step", -1) >= r["step"]:
            out.pop()
        out.append(r)
    return out


def _unique_labels(runs: list[dict[str, Any]]) -> None:
    seen: dict[str, int] = {}
    for r in runs:
        seen[r["label"]] = seen.get(r["label"], 0) + 1
    for r in runs:
        if seen[r["label"]] > 1:
            r["label"] = f"{r['label']} ({Path(r['run_dir']).name})"


def _parse_size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    if not (w.isdigit() and h.isdigit() and 200 <= int(w) <= 10000 and 200 <= int(h) <= 10000):
        raise ConfigError(f"--size {text!r}: write WIDTHxHEIGHT in pixels, each 200..10000 (e.g. 1400x1000).")
    return int(w), int(h)


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def draw(
    runs: list[dict[str, Any]], path: str | Path, size: tuple[int, int], title: str | None = None
) -> None:
    """The four panels of the module docstring, into ``path`` (``size`` in pixels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dpi = 100
    moe_runs = [r for r in runs if r.get("moe_step")]
    rows = 3 if moe_runs else 2
    fig, axes = plt.subplots(rows, 2, figsize=(size[0] / dpi, size[1] * rows / 2 / dpi), dpi=dpi)
    ax_loss, ax_tput, ax_mem, ax_prof = axes[0][0], axes[0][1], axes[1][0], axes[1][1]
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(runs):  # dashes differ so that curves lying on each other stay visible
        ax_loss.plot(r["step"], r["loss"], styles[i % 4], marker="o", markersize=3, label=r["label"])
    ax_loss.set(title="training loss (global mean)", xlabel="optimizer step", ylabel="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize="small")

    if any(r["samples_per_s"] for r in runs):
        for i, r in enumerate(runs):
            if r["samples_per_s"]:
                ax_tput.plot(r["throughput_step"], r["samples_per_s"], styles[i % 4], marker="o",
                             markersize=3, label=r["label"])  # fmt: skip
        ax_tput.set(title="throughput per logging interval", xlabel="optimizer step", ylabel="samples/s")
        ax_tput.set_ylim(bottom=0)
        ax_tput.grid(alpha=0.3)
        ax_tput.legend(fontsize="small")
    else:
        ax_tput.set_title("throughput per logging interval")
        _empty(ax_tput, "no samples_per_s in metrics.jsonl\n(runs of an older paratrain)")

    with_mem = [r for r in runs if r["model_state_bytes_per_rank"]]
    ax_mem.set_title("memory per rank (largest rank)")
    if with_mem:
        xs = range(len(with_mem))
        rest = [r["model_state_bytes_per_rank"] / _MIB for r in with_mem]
        peak = [(r["peak_bytes_per_rank"] or 0) / _MIB for r in with_mem]
        ax_mem.bar([x - 0.2 for x in xs], rest, width=0.4, label="model state at rest")
        ax_mem.bar([x + 0.2 for x in xs], peak, width=0.4, label="peak during a step")
        ax_mem.set_xticks(list(xs), [r["label"] for r in with_mem], rotation=20, ha="right", fontsize="small")
        ax_mem.set_ylabel("MiB")
        ax_mem.set_ylim(0, 1.3 * max(rest + peak))  # room for the legend above the bars
        ax_mem.grid(axis="y", alpha=0.3)
        ax_mem.legend(fontsize="small", ncol=2, loc="upper left")
    else:
        _empty(ax_mem, "no summary.json (the run did not finish)")

    bars = [(r, rank) for r in runs if r["profile"] for rank in r["profile"].get("ranks", [])
            if rank.get("step_ms") is not None]  # fmt: skip
    ax_prof.set_title("time per step, per rank (--profile)")
    if bars:
        labels = [f"{r['label']}\nrank {rank['rank']}" if len(runs) > 1 else f"rank {rank['rank']}"
                  for r, rank in bars]  # fmt: skip
        compute = [rank["compute_ms"] for _, rank in bars]
        exposed = [rank["comm_exposed_ms"] for _, rank in bars]
        other = [rank["other_ms"] for _, rank in bars]
        xs = range(len(bars))
        ax_prof.bar(xs, compute, label="compute", color="tab:green")
        ax_prof.bar(xs, exposed, bottom=compute, label="exposed communication", color="tab:red")
        ax_prof.bar(xs, other, bottom=[c + e for c, e in zip(compute, exposed, strict=True)], label="other",
                    color="0.7")  # fmt: skip
        ax_prof.set_xticks(list(xs), labels, fontsize="small")
        ax_prof.set_ylabel("ms per step")
        ax_prof.set_ylim(0, 1.3 * max(c + e + o for c, e, o in zip(compute, exposed, other, strict=True)))
        ax_prof.grid(axis="y", alpha=0.3)
        ax_prof.legend(fontsize="small", ncol=3, loc="upper left")
    else:
        _empty(ax_prof, "no profile/summary.json\n(run paratrain train --profile START:END)")
    if moe_runs:
        _draw_moe(axes[2][0], axes[2][1], moe_runs, styles)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _draw_moe(ax_load: Any, ax_experts: Any, runs: list[dict[str, Any]], styles: list[str]) -> None:
    """Expert load over the steps of every MoE run; tokens per expert and layer of the first one's last step."""
    for i, r in enumerate(runs):
        ax_load.plot(
            r["moe_step"], r["moe_overload"], styles[i % 4], marker="o", markersize=3, label=r["label"]
        )
    ax_load.set(title="expert load: busiest expert / mean (largest layer)", xlabel="optimizer step",
                ylabel="overload")  # fmt: skip
    ax_load.axhline(1.0, color="0.6", linewidth=0.8)
    ax_load.grid(alpha=0.3)
    ax_load.legend(fontsize="small")
    table = runs[0]["moe_tokens_per_expert"] or []
    ax_experts.set_title(f"tokens per expert, last logged step ({runs[0]['label']})")
    if table:
        image = ax_experts.imshow(table, aspect="auto", cmap="viridis")
        ax_experts.set(xlabel="expert", ylabel="MoE layer")
        ax_experts.figure.colorbar(image, ax=ax_experts)
    else:
        _empty(ax_experts, "no tokens_per_expert in metrics.jsonl")


def run(args: argparse.Namespace) -> int:
    """``paratrain plot``; a bad argument raises :class:`ConfigError` (exit 2 from the CLI)."""
    size = _parse_size(args.size)
    out = Path(args.output)
    if not out.resolve().parent.is_dir():
        raise ConfigError(f"-o {args.output}: directory {out.parent} does not exist.")
    if out.suffix.lower() != ".png":
        raise ConfigError(f"-o {args.output}: paratrain plot writes PNG; give a name ending in .png.")
    runs = [load_run(d) for d in args.run_dirs]
    _unique_labels(runs)
    draw(runs, out, size, args.title)
    if args.json:
        print(json.dumps({"output": str(out), "size": list(size), "runs": runs}))
    else:
        print(f"wrote {out} ({size[0]}x{size[1]}): {len(runs)} run(s)", file=sys.stderr)
    return 0
