"""The machine a plan is for: GPUs, their memory and FLOP/s, and two α–β links (inside a node, across nodes).

Presets (figures from the vendors' data sheets; the link figures are per GPU and per direction, the way
nccl-tests' busbw is measured, so a ring collective on a link of ``bw`` has busbw ≈ ``bw``):

- ``h100-nvlink-ib``: H100 SXM5, 989 TFLOP/s dense BF16 (1,979 with 2:4 sparsity; NVIDIA H100 Tensor Core
  GPU datasheet), 80 GB HBM3. NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s per direction (the
  order of nccl-tests' intra-node all_reduce busbw on a DGX H100). Inter-node: one ConnectX-7 400 Gb/s
  InfiniBand NIC per GPU (DGX H100 user guide) = 50 GB/s per GPU.
- ``a100-nvlink-ib``: A100 SXM4 80GB, 312 TFLOP/s dense BF16 (NVIDIA A100 datasheet). NVLink 3: 600 GB/s
  bidirectional = 300 GB/s per direction. One 200 Gb/s HDR NIC per GPU (DGX A100) = 25 GB/s per GPU.
- ``h200-nvlink-ib``, ``b200-nvlink-ib``, ``mi300x-xgmi-ib``: the same kind of 8-GPU node with those GPUs
  (:data:`GPUS`) and their links (NVLink 5 on B200: 1.8 TB/s bidirectional; MI300X's Infinity Fabric, 64 GB/s per
  direction to each of 7 peers).
- ``paratrain plan --gpu KEY`` swaps only the GPU of a preset: ``h100``, ``h200``, ``b200``, ``a100-40gb``,
  ``a100-80gb``, ``mi300x``, each row of :data:`GPUS` with its data sheet named; the peak follows the plan's
  precision (:meth:`GPU.flops`).
- ``cpu-local``: the ranks of one machine talking through Gloo. α and β default to the figures measured on
  a small Linux host (BENCHMARKS.md: α = 294 µs, β = 1.48 ns/B); :func:`calibrate` refits them from
  ``paratrain bench comm --json`` output. ``gpu_flops`` is a rough per-process fp32 figure (one AVX2 core:
  2 FMA units × 8 lanes × 2 FLOP × ~3 GHz ≈ 1e11); override it with ``--gpu-flops``.

Latencies are per algorithm step, the order of NCCL's own tuning model (``src/graph/tuning.cc``, ring with the
Simple protocol: ~3.4 µs per step over NVLink, ~14 µs per step over the network).

Sizes: ``"80GB"`` is 80e9 bytes (SI, as GPU memory is marketed and as the ZeRO paper counts), ``"80GiB"`` is
80 × 2^30. Bandwidths: ``"450GB/s"`` bytes per second, ``"400Gb/s"`` bits per second (÷ 8).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError, suggest


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. Bandwidths are bytes/s per GPU per direction; latencies are seconds per message."""

    gpus: int
    """Total number of GPUs (ranks)."""
    gpus_per_node: int
    """GPUs that share one fast intra-node link (NVLink); groups larger than this cross nodes."""
    gpu_mem_bytes: float
    """Memory of one GPU, bytes."""
    gpu_flops: float
    """Peak dense FLOP/s of one GPU at the training precision."""
    intra_bw: float
    """Intra-node link bandwidth per GPU, bytes/s (1/β)."""
    intra_latency: float
    """Intra-node α, seconds per algorithm step."""
    inter_bw: float
    """Inter-node bandwidth per GPU (its NIC), bytes/s."""
    inter_latency: float
    """Inter-node α, seconds per algorithm step that crosses nodes."""
    efficiency: float = 0.5
    """Fraction of ``gpu_flops`` a training step achieves on its matmuls."""
    name: str = "custom"
    """Preset name, or ``custom``."""
    fp8_flops: float = 0.0
    """Dense fp8 tensor-core FLOP/s of one GPU (0: none); ``paratrain plan --fp8`` runs the layers' linear
    matmuls at it. Follows ``--gpu``, not ``--gpu-flops``."""
    matmul_knee: float = 0.0
    """0: ``efficiency`` is the whole step's. Above 0: ``efficiency`` is that of a wide matmul, and a matmul whose
    narrowest side (per rank: tokens of a micro-batch, input or output width) is ``w`` runs at ``w / (w + knee)``
    of it; attention at :data:`paratrain.plan.time.ATTENTION_RELATIVE` of it (``compute_slowdown`` there). The
    calibrated GPU defaults use :data:`MATMUL_KNEE`."""

    def __post_init__(self) -> None:
        for f in ("gpus", "gpus_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"cluster: {f} must be a positive integer, got {v!r}.")
        for f in ("gpu_mem_bytes", "gpu_flops", "intra_bw", "inter_bw"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"cluster: {f} must be positive, got {getattr(self, f)!r}.")
        for f in ("intra_latency", "inter_latency"):
            if getattr(self, f) < 0:
                raise ConfigError(f"cluster: {f} must not be negative, got {getattr(self, f)!r}.")
        if not self.matmul_knee >= 0:
            raise ConfigError(
                f"cluster: matmul_knee must be 0 (off) or a positive width, got {self.matmul_knee!r}."
            )
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"cluster: efficiency must be in (0, 1], got {self.efficiency!r}.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ConfigError(
                f"cluster: {self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}; choose --gpus a "
                f"multiple of --gpus-per-node {self.gpus_per_node}."
            )

    @property
    def on_cpu(self) -> bool:
        """Ranks on CPUs talking through Gloo (``cpu-local``): Gloo's collectives and torch's CPU optimizer
        paths decide some of the step's temporary buffers (:mod:`paratrain.plan.peak`)."""
        return self.name.startswith("cpu-local")

    @property
    def nodes(self) -> int:
        return max(1, -(-self.gpus // self.gpus_per_node))

    def with_gpus(self, gpus: int) -> Cluster:
        """The same machine with ``gpus`` GPUs (``gpus_per_node`` capped at ``gpus``)."""
        return replace(self, gpus=gpus, gpus_per_node=min(self.gpus_per_node, gpus))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_GB = 1e9


@dataclass(frozen=True)
class GPU:
    """One accelerator's data-sheet figures: dense peak FLOP/s (no 2:4 sparsity) and memory."""

    name: str
    """Fragment of the device name as ``torch.cuda.get_device_name`` reports it (``H100``)."""
    half_flops: float
    """Dense bf16/fp16 tensor-core FLOP/s."""
    single_flops: float
    """Dense fp32 FLOP/s (tf32 where the vendor quotes it for training)."""
    mem_bytes: float
    source: str
    key: str = ""
    """The ``paratrain plan --gpu`` preset name (``h100``), empty for a table entry without one."""
    fp8_flops: float = 0.0
    """Dense fp8 tensor-core FLOP/s (0: no fp8 tensor cores)."""

    def flops(self, precision: str) -> float:
        """Peak dense FLOP/s at a training precision (``fp8``, 16-bit, else fp32)."""
        if precision == "fp8" and self.fp8_flops:
            return self.fp8_flops
        return self.half_flops if precision in ("bf16", "fp16", "fp16-mixed") else self.single_flops


GPUS: tuple[GPU, ...] = (
    GPU(
        "MI300X",
        1307.4e12,
        163.4e12,
        192 * _GB,
        "AMD Instinct MI300X data sheet (OAM; dense, no sparsity)",
        "mi300x",
        2614.9e12,
    ),
    GPU(
        "B200",
        2250e12,
        75e12,
        180 * _GB,
        "NVIDIA HGX B200 datasheet: per GPU, 1/8 of the 8-GPU board, dense (half the quoted sparse FP16/FP8)",
        "b200",
        4500e12,
    ),
    GPU("H200", 989e12, 67e12, 141 * _GB, "NVIDIA H200 Tensor Core GPU datasheet (SXM)", "h200", 1979e12),
    GPU("H100", 989e12, 67e12, 80 * _GB, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)", "h100", 1979e12),
    GPU(
        "A100-SXM4-40GB",
        312e12,
        19.5e12,
        40 * _GB,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)",
        "a100-40gb",
    ),
    GPU("A100", 312e12, 19.5e12, 80 * _GB, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)", "a100-80gb"),
    GPU("L40S", 362e12, 91.6e12, 48 * _GB, "NVIDIA L40S datasheet"),
    GPU("A10", 125e12, 31.2e12, 24 * _GB, "NVIDIA A10 datasheet"),
    GPU("V100", 125e12, 15.7e12, 32 * _GB, "NVIDIA V100 datasheet (SXM2)"),
)
"""The one table of GPU peaks, read by MFU (:func:`paratrain.runtime.device_peak_flops`) and the planner.
Longer names first, so that ``H100`` is not taken for ``H10``."""


EFFICIENCY: dict[tuple[str, str], float] = {
    ("H100", "16-bit"): 0.488,
    ("H100", "16-bit compiled"): 0.583,
    ("H100", "fp8 compiled"): 0.509,
    ("H200", "16-bit"): 0.488,
    ("H200", "16-bit compiled"): 0.583,
    ("H200", "fp8 compiled"): 0.509,
    ("A100", "16-bit"): 0.754,
    ("A100", "16-bit compiled"): 0.864,
}
"""Default fraction of the dense peak a *wide* matmul achieves in a training step, per GPU family and compute
(:func:`compute_key`: the precision, ``fp8`` for Float8 linears, `` compiled`` with ``--compile``); the plan
applies it with the width model of :data:`MATMUL_KNEE` (narrower matmuls and attention slower). Each is the
geometric mean of the wide-matmul efficiencies implied by the published runs of
``benchmarks/bench_plan_published.py`` that are not held out (docs/plan.md, "Calibrated time"). H100 bf16 eager:
torchtitan's Llama 3.1 8B FSDP rows on 8 and 128 GPUs (implied 0.496, 0.482; H100s at 500 W with HBM2e) and IBM
fms-fsdp's Llama 2 7B (HSDP), 13B and 70B (FSDP) on 96 H100s (0.441, 0.474, 0.551); H100 16-bit compiled: the same
rows with torch.compile (0.573, 0.560; 0.564, 0.605, 0.614); H100 fp8 compiled: every torchtitan row with
torch.compile + Float8 (8B FSDP on 8 and 128 GPUs, 70B FSDP x TP, 405B FSDP x TP x PP with 1F1B, interleaved
1F1B and 1F1B at 32k tokens: 0.435-0.590, the fp8 peak for the layers' linears and the 16-bit peak for the
rest); H200 takes the H100's (same chip, no fitted row). A100 bf16 eager: fms-fsdp's 7B, 13B, 70B on 128 A100s
(0.689, 0.712, 0.808) and Megatron-LM's GPT-3 175B on 1,536 GPUs (Narayanan et al. 2021 Table 2, 141 TFLOP/s:
0.813, fused kernels, recomputation counted as the paper counts it); A100 16-bit compiled: fms-fsdp's 7B, 13B,
70B with torch.compile (0.848, 0.850, 0.896). Other GPUs, fp32, and fp8 without compile keep
:attr:`Cluster.efficiency`'s 0.5 as the whole step's (no width model). ``--efficiency`` wins (the whole step's,
unless ``--matmul-knee`` is given too)."""


MATMUL_KNEE = 800.0
"""The width model of the calibrated defaults (:attr:`Cluster.matmul_knee`): a matmul whose narrowest side on the
rank is 800 runs at half a wide matmul's efficiency, one 8,192 wide at 0.91 of it. Fitted with
:data:`paratrain.plan.time.ATTENTION_RELATIVE` by ``benchmarks/fit_matmul_knee.py`` on the fitted rows of
``bench_plan_published.py`` and MosaicML's 113 MPT rows (``bench_plan_mpt.py``): the pair with which the
wide-matmul efficiencies the rows of one GPU family and compute imply are most alike (docs/plan.md, "Calibrated
time")."""


def compute_key(precision: str, compiled: bool = False, fp8: bool = False) -> str:
    """The :data:`EFFICIENCY` key of a run's compute: ``16-bit``, ``fp32``, ``fp8`` (Float8 linears), each
    with `` compiled`` under ``torch.compile``."""
    base = "fp8" if fp8 else "16-bit" if precision in ("bf16", "fp16", "fp16-mixed") else precision
    return base + (" compiled" if compiled else "")


def default_efficiency(
    gpu_name: str, precision: str, compiled: bool = False, fp8: bool = False
) -> float | None:
    """:data:`EFFICIENCY` for a cluster's GPU (a preset or device name) and compute, or None."""
    key = compute_key(precision, compiled, fp8)
    for (family, prec), e in EFFICIENCY.items():
        if family.lower() in gpu_name.lower() and prec == key:
            return e
    return None


def gpu(key: str) -> GPU:
    """The ``--gpu`` preset ``key`` (``h100``, ``h200``, ``b200``, ``a100-40gb``, ``a100-80gb``, ``mi300x``)."""
    keys = {g.key: g for g in GPUS if g.key}
    if key not in keys:
        raise ConfigError(f"unknown GPU {key!r}. {suggest(key, keys)} (or give --gpu-mem and --gpu-flops)")
    return keys[key]


def gpu_peak_flops(device_name: str, precision: str = "bf16") -> float | None:
    """Peak dense FLOP/s of the GPU called ``device_name`` at ``precision`` (16-bit for bf16/fp16), or
    ``None`` when it is not in :data:`GPUS` (never guessed)."""
    for gpu in GPUS:
        if gpu.name in device_name:
            return gpu.half_flops if precision in ("bf16", "fp16") else gpu.single_flops
    return None


PRESETS: dict[str, Cluster] = {
    "h100-nvlink-ib": Cluster(
        gpus=8, gpus_per_node=8, gpu_mem_bytes=80 * _GB, gpu_flops=989e12, intra_bw=450 * _GB,
        intra_latency=3.4e-6, inter_bw=50 * _GB, inter_latency=14e-6, name="h100-nvlink-ib", fp8_flops=1979e12,
    ),
    "a100-nvlink-ib": Cluster(
        gpus=8, gpus_per_node=8, gpu_mem_bytes=80 * _GB, gpu_flops=312e12, intra_bw=300 * _GB,
        intra_latency=3.4e-6, inter_bw=25 * _GB, inter_latency=14e-6, name="a100-nvlink-ib",
    ),
    "h200-nvlink-ib": Cluster(  # an H100 system's links (NVLink 4, one 400 Gb/s NIC per GPU), 141 GB
        gpus=8, gpus_per_node=8, gpu_mem_bytes=141 * _GB, gpu_flops=989e12, intra_bw=450 * _GB,
        intra_latency=3.4e-6, inter_bw=50 * _GB, inter_latency=14e-6, name="h200-nvlink-ib", fp8_flops=1979e12,
    ),
    "b200-nvlink-ib": Cluster(  # NVLink 5: 1.8 TB/s bidirectional per GPU; ConnectX-7 400 Gb/s per GPU
        gpus=8, gpus_per_node=8, gpu_mem_bytes=180 * _GB, gpu_flops=2250e12, intra_bw=900 * _GB,
        intra_latency=3.4e-6, inter_bw=50 * _GB, inter_latency=14e-6, name="b200-nvlink-ib", fp8_flops=4500e12,
    ),
    "mi300x-xgmi-ib": Cluster(  # Infinity Fabric: 7 links x 64 GB/s per direction to the 7 peers; 400 Gb/s NIC
        gpus=8, gpus_per_node=8, gpu_mem_bytes=192 * _GB, gpu_flops=1307.4e12, intra_bw=448 * _GB,
        intra_latency=3.4e-6, inter_bw=50 * _GB, inter_latency=14e-6, name="mi300x-xgmi-ib", fp8_flops=2614.9e12,
    ),
    "cpu-local": Cluster(
        gpus=2, gpus_per_node=2, gpu_mem_bytes=8 * _GB, gpu_flops=1e11, intra_bw=1 / 1.48e-9,
        intra_latency=294e-6, inter_bw=1 / 1.48e-9, inter_latency=294e-6, name="cpu-local",
    ),
}  # fmt: skip


def preset(name: str) -> Cluster:
    """The named preset; ``cpu-local`` gets this machine's memory split over its default 2 ranks."""
    if name not in PRESETS:
        raise ConfigError(f"unknown cluster preset {name!r}. {suggest(name, PRESETS)}")
    c = PRESETS[name]
    if name == "cpu-local":
        c = replace(c, gpu_mem_bytes=_host_memory() / c.gpus_per_node)
    return c


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * _GB


# ---- units -----------------------------------------------------------------------------------------------
_NUM = r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/µ]*)\s*$"
_SIZE_UNITS = {"": 1.0, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2.0**10, "mib": 2.0**20, "gib": 2.0**30, "tib": 2.0**40}  # fmt: skip
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _finite(value: float, what: str, text: str) -> float:
    """``value`` unless it is infinite (``1e400GB`` reads as infinity): :class:`ConfigError`."""
    if not math.isfinite(value):
        raise ConfigError(f"{what}: {text!r} is not a finite number; give e.g. 80GB.")
    return value


def parse_size(text: str | float, what: str = "size") -> float:
    """``"80GB"`` → 8e10, ``"80GiB"`` → 80·2^30, ``"1.5e9"`` → 1.5e9 bytes."""
    if isinstance(text, int | float):
        return float(text)
    m = re.match(_NUM, text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"{what}: cannot read {text!r} as a size; write e.g. 80GB (1e9), 80GiB (2^30) or 8e10."
        )
    return _finite(float(m.group(1)) * _SIZE_UNITS[unit], what, text)


def parse_bandwidth(text: str | float, what: str = "bandwidth") -> float:
    """Bytes/s: ``"450GB/s"`` (bytes), ``"400Gb/s"`` (bits: ÷ 8), ``"5e10"``."""
    if isinstance(text, int | float):
        return float(text)
    m = re.match(_NUM, text)
    raw = m.group(2) if m else ""
    if not m or not (raw == "" or raw.endswith("/s")):
        raise ConfigError(
            f"{what}: cannot read {text!r}; write e.g. 450GB/s (bytes), 400Gb/s (bits) or 4.5e11."
        )
    unit = raw[:-2]
    bits = unit.endswith("b") and not unit.endswith("B")
    key = unit.lower()
    if key not in _SIZE_UNITS:
        raise ConfigError(f"{what}: unknown unit in {text!r}; use B/s, KB/s, MB/s, GB/s, Gb/s or a number.")
    return _finite(float(m.group(1)) * _SIZE_UNITS[key] / (8 if bits else 1), what, text)


def parse_time(text: str | float, what: str = "latency") -> float:
    """Seconds: ``"5us"``, ``"2ms"``, ``"1e-5"``."""
    if isinstance(text, int | float):
        return float(text)
    m = re.match(_NUM, text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _TIME_UNITS:
        raise ConfigError(f"{what}: cannot read {text!r} as a time; write e.g. 5us, 2ms or 1e-5.")
    return float(m.group(1)) * _TIME_UNITS[unit]


def parse_flops(text: str | float, what: str = "--gpu-flops") -> float:
    """FLOP/s: ``"989e12"``, ``"989T"``, ``"312TFLOPS"``."""
    if isinstance(text, int | float):
        return float(text)
    m = re.match(
        r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKMGTP]?)(?:FLOPS|flops|FLOP/s|flop/s)?\s*$", text
    )
    if not m:
        raise ConfigError(f"{what}: cannot read {text!r}; write e.g. 989e12 or 989T.")
    scale = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}[m.group(2)]
    return float(m.group(1)) * scale


# ---- calibration from `paratrain bench comm --json` -------------------------------------------------------
def _runs(doc: Any) -> list[dict[str, Any]]:
    """The result objects in a bench file: one ``paratrain bench comm --json`` object, a list of them, or
    the ``{"command": ..., "runs": [...]}`` files of benchmarks/results/."""
    if isinstance(doc, list):
        return [r for d in doc for r in _runs(d)]
    if isinstance(doc, dict) and isinstance(doc.get("runs"), list):
        return _runs(doc["runs"])
    if isinstance(doc, dict) and isinstance(doc.get("results"), list):
        return [doc]
    return []


def fit_alpha_beta(points: list[tuple[int, float, float]]) -> tuple[float, float]:
    """Fit the ring all-reduce model t = 2(n−1)α + 2(n−1)/n·S·β to ``(n, S, t)`` points.

    Least squares on the *relative* error, min Σ ((2(n−1)α + 2(n−1)/n·Sβ − t) / t)², so that 1 KB messages
    (latency-bound, ms) weigh as much as 256 MB ones (bandwidth-bound, s). Linear in (α, β): solved in
    closed form from the 2×2 normal equations; negative values are clamped to 0 (then β or α is refit alone).
    """
    rows = [(2 * (n - 1) / t, 2 * (n - 1) / n * s / t) for n, s, t in points if t > 0 and n > 1]
    if len(rows) < 2:
        raise ConfigError("--calibrate: need all_reduce rows at two or more sizes on more than one rank.")
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)  # right-hand side: Σ x_i · 1
    det = saa * sbb - sab * sab
    alpha, beta = ((sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det) if det else (0.0, 0.0)
    if alpha < 0:
        alpha, beta = 0.0, sb / sbb
    if beta <= 0:
        alpha, beta = sa / saa, 1e-12
    return alpha, beta


def calibrate(path: str | Path, base: Cluster | None = None) -> Cluster:
    """``cpu-local`` (or ``base``) with α and β fitted to the native all_reduce rows of a bench JSON file.

    Uses every ``{"collective": "all_reduce", "algorithm": "native"}`` row (``bytes`` = S, ``time_s`` = the
    median of the slowest rank) of every run in the file; each run's ``world_size`` is n. The backend's own
    all-reduce is what training uses, so it is what the planner should predict. Both links get the fit (one
    machine). ``gpus`` and ``gpus_per_node`` become the ranks the bench ran with.
    """
    p = Path(path)
    if p.exists() and not p.is_file():  # a FIFO or a device would block or never end
        raise ConfigError(
            f"--calibrate {path}: not a regular file. Give the JSON file `paratrain bench comm --json` wrote."
        )
    try:
        doc = json.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"--calibrate {path}: no such file. Write one with `paratrain bench comm --json > FILE`."
        ) from None
    except (OSError, ValueError, RecursionError) as e:  # unreadable, not UTF-8 (a binary file), not JSON
        raise ConfigError(
            f"--calibrate {path}: cannot read it as JSON ({type(e).__name__}: {str(e)[:120]})."
        ) from None
    try:
        points = [
            (int(run["world_size"]), float(r["bytes"]), float(r["time_s"]))
            for run in _runs(doc)
            for r in run["results"]
            if r.get("collective") == "all_reduce" and r.get("algorithm") == "native"
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(
            f"--calibrate {path}: not the JSON of `paratrain bench comm --json` ({type(e).__name__}: {e})."
        ) from None
    if not points:
        raise ConfigError(
            f"--calibrate {path}: no native all_reduce rows; run `paratrain bench comm --collectives all_reduce "
            "--algorithms native --sizes 1KB..64MB --json > FILE`."
        )
    alpha, beta = fit_alpha_beta(points)
    ranks = max(n for n, _, _ in points)
    c = base or replace(preset("cpu-local"), gpu_mem_bytes=_host_memory() / ranks)
    return replace(
        c, gpus=ranks, gpus_per_node=ranks, intra_bw=1 / beta, inter_bw=1 / beta, intra_latency=alpha,
        inter_latency=alpha, name=f"{c.name} (calibrated from {p.name})",
    )  # fmt: skip
