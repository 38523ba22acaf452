"""``paratrain bench comm``: time collectives over a sweep of message sizes, native vs paratrain's algorithms.

    paratrain bench comm --nproc-per-node 4 --collectives all_reduce --sizes 1KB..256MB
    paratrain bench comm --collectives all --sizes 4KB,1MB,16MB --json
    paratrain bench comm --sizes 1KB..64MB --plot busbw.png

This process validates every argument first (one clear error, nothing started), then launches N ranks of
:mod:`paratrain.bench.comm_worker` with the torch elastic agent (:func:`paratrain.launch.run_module`),
reads rank 0's JSON, and prints a table (or ``--json``) and draws ``--plot``. Sizes use binary units as
nccl-tests does (1KB = 1024 B). For each size and algorithm it reports the median time, algbw = S/t and
busbw = algbw × factor with nccl-tests' factors (see :mod:`paratrain.spec.cost`), the α–β model's
prediction, and busbw relative to the backend's native collective *measured in the same run*.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.comm._check import ALGORITHMS
from paratrain.comm._ops import OPS
from paratrain.config import LaunchConfig, add_command_arguments, command_config, option
from paratrain.errors import ConfigError
from paratrain.spec.cost import BUS_FACTORS
from paratrain.tables import Col, table

COLLECTIVES = tuple(BUS_FACTORS)  # all_reduce, all_gather, reduce_scatter, broadcast, reduce
DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZES_HELP = "write sizes like 4096, 64KB, 16MB, a list 4KB,1MB or a range 1KB..256MB (×--factor each step)"


def parse_size(text: str) -> int:
    """``"64KB"`` → 65536. Binary units (K/KB/KiB = 1024, M, G), case-insensitive."""
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise ConfigError(f"--sizes: cannot read {text.strip()!r} as a size; {_SIZES_HELP}.")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"--sizes: {text.strip()!r} is less than one byte.")
    return value


def parse_sizes(text: str, factor: int = 2) -> list[int]:
    """``"1KB..1MB"`` → 1 KiB, 2 KiB, .. 1 MiB (×``factor``); comma-separated items and ranges mix."""
    if factor < 2:
        raise ConfigError(f"--factor must be at least 2, got {factor}.")
    sizes: set[int] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        if ".." in item:
            lo_text, hi_text = item.split("..", 1)
            lo, hi = parse_size(lo_text), parse_size(hi_text)
            if lo > hi:
                raise ConfigError(f"--sizes: range {item!r} goes down; write the smaller size first.")
            size = lo
            while size <= hi:
                sizes.add(size)
                size *= factor
        else:
            sizes.add(parse_size(item))
    if not sizes:
        raise ConfigError(f"--sizes is empty; {_SIZES_HELP}.")
    return sorted(sizes)


def format_size(nbytes: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{int(nbytes)}B"


def _names(flag: str, text: str, choices: tuple[str, ...]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(choices)
    bad = [n for n in names if n not in choices]
    if bad or not names:
        raise ConfigError(
            f"{flag}: unknown {', '.join(map(repr, bad)) or 'empty list'}; choose from {', '.join(choices)} or all."
        )
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class BenchCommConfig:
    """``paratrain bench comm``: what to time, over how many ranks (its flags are these fields)."""

    nproc_per_node: int = option(4)
    """Local ranks to launch."""
    collectives: str = option("all_reduce")
    """Comma list of all_reduce, all_gather, reduce_scatter, broadcast, reduce, or all."""
    algorithms: str = option("all")
    """Comma list of native, naive, tree, ring, rhd, shm, or all (each collective runs those it has)."""
    sizes: str = option("1KB..16MB")
    """Message sizes S: write sizes like 4096, 64KB, 16MB, a list 4KB,1MB or a range 1KB..256MB (×--factor each
    step)."""
    factor: int = option(2)
    """Step of a size range."""
    iters: int = option(20)
    """Timed iterations per size."""
    warmup: int = option(5)
    """Untimed iterations first."""
    dtype: str = option("float32", choices=DTYPES)
    """Element type of the messages."""
    op: str = option("sum")
    """Reduction op: sum, mean, max, min or prod."""
    backend: str = option("auto")
    """auto (NCCL with CUDA, else Gloo), gloo or nccl."""
    device: str = option("auto")
    """auto, cpu or cuda."""
    timeout: float = option(300.0)
    """Process-group timeout in seconds."""
    cpu_bind: str = option("none", choices=("none", "cores"))
    """cores: pin each rank to its own block of cores, as paratrain launch --cpu-bind cores."""
    plot: str | None = option(None, metavar="PNG")
    """Draw busbw against size, one line per algorithm."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}.")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"--iters must be >= 1 and --warmup >= 0, got {self.iters} and {self.warmup}.")
        if self.op not in OPS:
            raise ConfigError(f"--op {self.op!r} is not an op; choose one of {', '.join(OPS)}.")
        if self.op == "mean" and self.dtype.startswith("int"):
            raise ConfigError(
                f"--op mean needs a float --dtype (the mean of {self.dtype} is not an integer)."
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``paratrain bench comm`` (the CLI adds them to its ``bench comm`` subcommand)."""
    add_command_arguments(parser, BenchCommConfig)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def build_spec(args: argparse.Namespace) -> tuple[dict[str, Any], LaunchConfig]:
    """Validate every argument and return the workers' spec and the launch config. Raises ConfigError."""
    cfg = command_config(BenchCommConfig, args)
    collectives = _names("--collectives", cfg.collectives, COLLECTIVES)
    offered = tuple(dict.fromkeys(a for c in collectives for a in ALGORITHMS[c]))
    algorithms = _names("--algorithms", cfg.algorithms, offered)
    if cfg.plot is not None and not Path(cfg.plot).resolve().parent.is_dir():
        raise ConfigError(f"--plot {cfg.plot}: directory {Path(cfg.plot).parent} does not exist.")
    launch = LaunchConfig(
        nproc_per_node=cfg.nproc_per_node, backend=cfg.backend, device=cfg.device, timeout_s=cfg.timeout,
        cpu_bind=cfg.cpu_bind,
    )  # fmt: skip
    spec = {
        "collectives": collectives,
        "algorithms": algorithms,
        "sizes": parse_sizes(cfg.sizes, cfg.factor),
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "dtype": cfg.dtype,
        "op": cfg.op,
        "backend": cfg.backend,
        "device": cfg.device,
        "timeout_s": cfg.timeout,
        "cpu_bind": cfg.cpu_bind,
    }
    return spec, launch


def measure(spec: dict[str, Any], launch: LaunchConfig) -> dict[str, Any]:
    """Launch the ranks, wait, return rank 0's result. Raises ``paratrain.launch.LaunchError``."""
    from paratrain.launch import run_module

    with tempfile.TemporaryDirectory(prefix="paratrain-bench-comm-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps(spec))
        run_module("paratrain.bench.comm_worker", [str(spec_path), str(out_path)], launch)
        return dict(json.loads(out_path.read_text()))


def winners(result: dict[str, Any]) -> dict[str, dict[str, list[int]]]:
    """``{collective: {algorithm: [sizes where it was fastest]}}``."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for row in result["results"]:
        key = (row["collective"], row["bytes"])
        if key not in best or row["time_s"] < best[key]["time_s"]:
            best[key] = row
    out: dict[str, dict[str, list[int]]] = {}
    for (collective, nbytes), row in sorted(best.items()):
        out.setdefault(collective, {}).setdefault(row["algorithm"], []).append(nbytes)
    return out


def format_table(result: dict[str, Any]) -> str:
    m = result["model"]
    beta = m["beta_s_per_byte"]
    lines = [
        f"paratrain bench comm: {result['world_size']} ranks, {result['backend']} on {result['device']}, "
        f"{result['dtype']}, op={result['op']}; median over {result['iters']} iterations (after "
        f"{result['warmup']} warm-up) of the slowest rank's time",
        f"α–β model: α = {m['alpha_s'] * 1e6:.1f} us (ping-pong), β = {beta * 1e9:.3f} ns/B = "
        f"{_gbps(beta)} GB/s per link with all ranks sending (a lone ping-pong: "
        f"{_gbps(m.get('beta_pingpong_s_per_byte', 0.0))} GB/s), γ = {m['gamma_s_per_byte'] * 1e9:.3f} ns/B",
    ]
    rows = result["results"]
    native = {(r["collective"], r["bytes"]): r["busbw_GBps"] for r in rows if r["algorithm"] == "native"}
    cols = [Col("size", ">", 8), Col("algorithm", "<", 9, gap=2), Col("time (us)", ">", 11),
            Col("algbw GB/s", ">", 11), Col("busbw GB/s", ">", 11), Col("model (us)", ">", 11),
            Col("vs native", ">", 10)]  # fmt: skip
    for collective in dict.fromkeys(r["collective"] for r in rows):
        lines += ["", f"{collective} (busbw = algbw × {_factor_text(collective)})"]
        cells, notes = [], []
        last = None
        for r in (r for r in rows if r["collective"] == collective):
            size = format_size(r["bytes"]) if r["bytes"] != last else ""
            last = r["bytes"]
            ref = native.get((collective, r["bytes"]))
            cells.append([size, r["algorithm"], f"{r['time_s'] * 1e6:.1f}", f"{r['algbw_GBps']:.3f}",
                          f"{r['busbw_GBps']:.3f}", f"{r['model_s'] * 1e6:.1f}" if r["model_s"] is not None else "-",
                          f"{r['busbw_GBps'] / ref:.2f}x" if ref else "-"])  # fmt: skip
            notes.append(f"  ({r['shm_path']} path)" if "shm_path" in r else "")
        head, *body = table(cols, cells)
        lines += [head] + [line + note for line, note in zip(body, notes, strict=True)]
    lines += ["", "fastest algorithm by size:"]
    for collective, by_alg in winners(result).items():
        parts = [f"{alg} at {', '.join(format_size(s) for s in sizes)}" for alg, sizes in by_alg.items()]
        lines.append(f"  {collective}: " + "; ".join(parts))
    return "\n".join(lines)


def _gbps(beta: float) -> str:
    return f"{1 / beta / 1e9:.2f}" if beta > 0 else "inf"


def _factor_text(collective: str) -> str:
    return {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)/n", "reduce_scatter": "(n-1)/n"}.get(
        collective, "1"
    )


def plot(result: dict[str, Any], path: str) -> None:
    """busbw against message size, one line per algorithm, one panel per collective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    collectives = list(dict.fromkeys(r["collective"] for r in result["results"]))
    fig, axes = plt.subplots(1, len(collectives), figsize=(6 * len(collectives), 4.2), squeeze=False)
    for ax, collective in zip(axes[0], collectives, strict=True):
        rows = [r for r in result["results"] if r["collective"] == collective]
        for alg in dict.fromkeys(r["algorithm"] for r in rows):
            pts = [(r["bytes"], r["busbw_GBps"]) for r in rows if r["algorithm"] == alg]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=alg,
                    linestyle="--" if alg == "native" else "-")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_size(x)))
        ax.set_xlabel("message size S")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{collective}, {result['world_size']} ranks, {result['backend']}/{result['device']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    """Run ``paratrain bench comm``; returns the exit code (ConfigError propagates to the CLI: exit 2)."""
    from paratrain.launch import LaunchError

    spec, launch = build_spec(args)
    try:
        result = measure(spec, launch)
    except LaunchError as e:
        print(f"paratrain bench comm: {e}", file=sys.stderr)
        return 1
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
        if args.plot:
            print(f"\nwrote {args.plot}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="python -m paratrain.comm.bench", description=__doc__.splitlines()[0]
    )
    add_arguments(_parser)
    try:
        sys.exit(main(_parser.parse_args()))
    except ConfigError as _e:
        print(f"paratrain bench comm: error: {_e}", file=sys.stderr)
        sys.exit(2)
