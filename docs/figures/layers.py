"""Draw docs/figures/layers.png: paratrain's import layers (imports only run downward).

    python docs/figures/layers.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LAYERS = [
    ("cli", ["cli"], "parse flags, build a typed config, call one function"),
    ("tools", ["diagnose", "bench", "lint"], "doctor, guard, plot; bench; lint (torch-free)"),
    ("plan", ["plan"], "memory, communication, time: pure numbers, no torch"),
    ("launch", ["launch"], "torch elastic agent, rendezvous, failures, signals, slurm"),
    ("train", ["train"], "trainer, lifecycle, faults, worker entry, precision, metrics"),
    ("strategies", ["parallel", "checkpoint"], "one topology -> DeviceMesh; DCP storage"),
    ("inputs", ["data", "models"], "datasets, batches; models + their ModelSpec (TP/PP plans)"),
    ("algorithms", ["comm"], "collectives from send/recv; transports behind comm/communicator"),
    ("description", ["spec"], "torch-free: Topology, StrategySpec, hardware, cost, shapes"),
    ("process", ["runtime", "testing"], "Context / init, test harness"),
    ("config", ["config"], "typed dataclasses, one converter, generated flags"),
    ("errors", ["errors", "procfs", "tables"], "ConfigError, suggest(); /proc parser; text tables"),
]


def main() -> None:
    fig, ax = plt.subplots(figsize=(9, 6.4))
    n = len(LAYERS)
    for i, (_, pkgs, what) in enumerate(LAYERS):
        y = n - 1 - i
        width = 4.0 / len(pkgs)
        for j, pkg in enumerate(pkgs):
            x = j * width
            ax.add_patch(plt.Rectangle((x + 0.05, y + 0.1), width - 0.1, 0.8, color="#4c72b0", alpha=0.15 + 0.6 * (y / n)))
            ax.text(x + width / 2, y + 0.5, pkg, ha="center", va="center", fontsize=11, family="monospace")
        ax.text(4.2, y + 0.5, what, va="center", fontsize=9)
        if i < n - 1:
            ax.annotate("", xy=(2.0, y + 0.1), xytext=(2.0, y - 0.1 + 0.2), arrowprops={"arrowstyle": "-"})
    ax.annotate("imports run\ndownward only", xy=(-0.3, 0.5), xytext=(-0.3, n - 0.5), ha="center",
                arrowprops={"arrowstyle": "->", "lw": 2}, fontsize=9)  # fmt: skip
    ax.set_xlim(-0.9, 9.5)
    ax.set_ylim(0, n)
    ax.axis("off")
    ax.set_title("paratrain layers (checked by import-linter: `lint-imports`)")
    out = Path(__file__).with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
