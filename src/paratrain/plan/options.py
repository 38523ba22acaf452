"""The planner's own options (``paratrain plan`` takes every ``paratrain train`` flag besides these): the model
as a bare count, numerics train has no flag for, the cluster, and the output. Their flags are generated from
these fields (:func:`paratrain.config.add_command_arguments`), as train's are from :class:`RunConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config import option
from paratrain.errors import ConfigError
from paratrain.plan.activations import ATTENTION


@dataclass(frozen=True)
class PlanConfig:
    """``paratrain plan``'s own options (the run's own are train's config fields)."""

    params: float | None = option(None)
    """A bare parameter count, e.g. 7.5e9 (model states only)."""
    attention: str = option("sdpa", choices=ATTENTION)
    """Attention kernel: sdpa drops the a·s² term."""
    fp16_mixed: bool = option(False)
    """The ZeRO paper's mixed precision: fp16 params and grads + fp32 master, 2+2+12 bytes."""
    reduce_fp32: bool = option(False)
    """FSDP reduces and accumulates gradients in fp32 (torchtitan's mixed_precision_reduce default);
    paratrain's own FSDP reduces in the 16-bit compute dtype."""
    fp8_all_gather: bool = option(False)
    """FSDP gathers the layers' linear weights in float8 (torchao Float8Linear with
    enable_fsdp_float8_all_gather, as torchtitan's Float8 runs): 1-byte unsharded weights."""
    fp8: bool = option(False)
    """Float8 linears (torchao Float8Linear, torchtitan's [float8]): the layers' matmuls at the GPU's fp8 peak,
    attention and the output layer at 16-bit; time only."""
    compile_loss: bool = option(False)
    """The cross-entropy compiled (torchtitan with --compile since April 2025; paratrain compiles the blocks
    only): the logits kept in the compute dtype and one gradient of them, not fp32 log-probabilities and two
    fp32 gradients; memory only."""
    pp_return_outputs: bool = option(False)
    """Pipelines: the last stage keeps every micro-batch's output (the logits) until the next step, as torch's
    schedule.step does by default (return_outputs=True; torchtitan's runs); paratrain's train does not keep
    them."""
    moe_overload: float = option(1.0)
    """MoE: routed rows on the busiest rank over the mean (activations)."""
    cluster: str | None = option(None)
    """Cluster preset: h100-nvlink-ib (the default; cpu-local with --device cpu), a100-nvlink-ib,
    h200-nvlink-ib, b200-nvlink-ib, mi300x-xgmi-ib or cpu-local."""
    gpu: str | None = option(None)
    """Swap the preset's GPU: mi300x, b200, h200, h100, a100-40gb or a100-80gb (memory and peak FLOP/s at the
    precision, from each data sheet)."""
    calibrate: str | None = option(None, metavar="FILE")
    """Fit α, β from `paratrain bench comm --json` output."""
    gpus: int | None = option(None)
    """Total GPUs (ranks); default --nnodes x --nproc-per-node."""
    gpus_per_node: int | None = option(None)
    """GPUs per node."""
    gpu_mem: str | None = option(None)
    """Memory per GPU, e.g. 80GB (1e9) or 80GiB."""
    gpu_flops: str | None = option(None)
    """Peak FLOP/s per GPU, e.g. 989e12."""
    intra_bw: str | None = option(None)
    """Intra-node bandwidth per GPU, e.g. 450GB/s."""
    inter_bw: str | None = option(None)
    """Inter-node bandwidth per GPU, e.g. 400Gb/s."""
    intra_latency: str | None = option(None)
    """Intra-node latency, e.g. 5us."""
    inter_latency: str | None = option(None)
    """Inter-node latency, e.g. 10us."""
    efficiency: float | None = option(None)
    """Fraction of peak FLOP/s the step achieves (default: calibrated per GPU and precision, docs/plan.md: then
    the fraction a wide matmul achieves, narrower ones slower; see --matmul-knee)."""
    matmul_knee: float | None = option(None, metavar="WIDTH")
    """Width model: a matmul whose narrowest side per rank is WIDTH runs at half the efficiency of a wide one,
    and attention at 0.6 of it (default: 800 with the calibrated efficiency; 0, the efficiency is the whole
    step's, with --efficiency or an uncalibrated GPU)."""
    recommend: bool = option(False)
    """Search and rank every valid layout."""
    sweep_gpus: str | None = option(None, metavar="RANGE")
    """Best layout per GPU count: 8..4096 (x2) or 8,64,512."""
    top: int = option(5)
    """Layouts --recommend prints."""
    plot: str | None = option(None, metavar="PNG")
    """Bytes per rank by component, and the time breakdown."""

    def __post_init__(self) -> None:
        if self.top < 1:
            raise ConfigError(f"--top must be at least 1 (layouts to print), got {self.top}.")
