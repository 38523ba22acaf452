"""Mixture-of-experts models in the planner: expert parallelism's bytes, all-to-all volume and time.

Pure arithmetic (no torch). A plan of an expert-parallel strategy is the plan of the dense layout it builds
on (:data:`EP_STRATEGIES`: ``ep`` on ``ddp``, the dense part replicated; ``fsdp+ep`` on ``zero3``;
``fsdp+tp+ep`` on ``fsdp+tp``; ``fsdp+ep+pp`` on ``fsdp+pp``), with the expert terms replaced
(:func:`apply_expert_parallel`). ``ep`` borrows its ranks from one pipeline stage's ``dp x tp`` ranks; under
tensor parallelism the MoE blocks run sequence-parallel, so a rank routes ``s * b / tp`` tokens; under a
pipeline the busiest (first) stage holds ``ceil(moe_layers / pp)`` MoE layers, keeps the activations of as
many micro-batches as its schedule has in flight, and runs their all-to-alls:

- **parameters**: the routed experts, ``P_e = moe_layers * n_experts * 3 * dim * moe_hidden``, are divided by
  ``ep`` (``ep``: each rank holds ``n_experts / ep`` of them; the ``edp = N / ep`` copies replicate them), and
  by ``edp`` too under the ``fsdp+*`` ones (FSDP over the ranks left), which makes their model states those
  of the base layout (``zero3``: ``16 P / N`` in fp32 AdamW): every parameter, dense or expert, is held
  ``1 / (dp x tp)`` per rank of its stage. The router and the shared expert are dense (replicated or sharded
  with the dense part).
- **activations** of an MoE layer (paratrain's Llama, fp32 terms as :mod:`paratrain.plan.implementation`; part
  of every plan of an MoE model, the data-parallel ones with ``ep = 1`` included, through the stage's
  activations in :mod:`paratrain.plan.stage`, so each moment of the step and each checkpointing mode holds them):
  the routed rows ``r = top_k * s * b * overload`` (``--moe-overload``: the busiest rank's rows over the mean)
  keep the gathered input rows and the received rows (``2 r h``) under ``ep``, the expert GEMMs' outputs,
  silu and product (``4 r f_e``), the rows sent back and the combine's slots (``2 r h``), the router's fp32
  logits, scores and biased scores (``3 s b E``), and the shared expert's SwiGLU (``4 s b f_e n_shared``) in
  place of the dense MLP's ``4 s b f``.
- **all-to-all**: per MoE layer and direction (forward, backward), a rank sends ``2 * top_k * tokens * dim *
  (ep - 1) / ep`` elements (dispatch and combine; ``tokens`` its own, uniform routing); each all-to-all is ``ep
  - 1`` messages. Exposed time: ``volume * beta + 4 * (ep - 1) * alpha`` per layer, on the link of the ep
  group (ep consecutive ranks: inside a node when ``ep <= gpus_per_node``); no overlap is assumed.
- **dense gradient traffic** of ``ep``: the replicas all-reduce the dense gradients and the experts' over
  ``edp``; the base plan's all-reduce is scaled by the parameters that take part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from paratrain.errors import ConfigError

EP_STRATEGIES = {
    "ep": ("ddp", "none"),
    "fsdp+ep": ("zero3", "full"),
    "fsdp+tp+ep": ("fsdp+tp", "full"),
    "fsdp+ep+pp": ("fsdp+pp", "full"),
}
"""Expert-parallel strategy -> (the dense layout it builds on, its sharding)."""


@dataclass(frozen=True)
class MoEShape:
    """The MoE part of a Llama config (the field names of ``models.llama.LlamaConfig``)."""

    dim: int
    n_experts: int
    top_k: int
    n_shared_experts: float
    """Shared experts of ``moe_hidden`` each (a fraction when a shared expert is wider: Qwen2-MoE's)."""
    moe_hidden: int
    moe_layers: int
    ffn_hidden: int

    @property
    def expert_params(self) -> int:
        """Routed expert parameters of the whole model."""
        return self.moe_layers * self.n_experts * 3 * self.dim * self.moe_hidden

    def alltoall_elements(self, tokens: float, ep: int) -> float:
        """Elements a rank sends per MoE layer and direction: dispatch + combine of its ``tokens``."""
        return 2 * self.top_k * tokens * self.dim * (ep - 1) / ep


def moe_from_config(config: Any) -> MoEShape | None:
    """The :class:`MoEShape` of a config with ``n_experts > 0`` (duck-typed), else ``None``."""
    n = getattr(config, "n_experts", 0) or 0
    if n <= 0:
        return None
    every, first, layers = config.moe_every, config.first_dense_layers, config.n_layers
    moe_layers = sum(1 for i in range(first, layers) if (i - first) % every == 0)
    return MoEShape(
        dim=config.dim, n_experts=n, top_k=config.top_k, n_shared_experts=config.n_shared_experts,
        moe_hidden=config.moe_hidden or config.ffn_hidden, moe_layers=moe_layers, ffn_hidden=config.ffn_hidden,
    )  # fmt: skip


def check_ep(moe: MoEShape | None, ep: int, gpus: int, model: str) -> None:
    """What ``paratrain train`` refuses before launch, with its words."""
    if moe is None:
        raise ConfigError(
            f"expert parallelism (--ep {ep}) splits the experts of a mixture-of-experts model, and {model!r} has "
            "no MoE layer. Use an MoE model (llama-moe-small, mixtral-8x7b, qwen3-30b-a3b, deepseek-v3)."
        )
    if ep < 1 or gpus % ep:
        raise ConfigError(f"--ep {ep} does not divide the {gpus} data-parallel ranks it borrows from.")
    if moe.n_experts % ep:
        raise ConfigError(
            f"--ep {ep} does not divide the model's {moe.n_experts} experts (model.n_experts={moe.n_experts})."
        )


def moe_activation_delta(moe: MoEShape, s: int, b: float, ep: int, overload: float, e: int = 4) -> float:
    """Bytes an MoE layer keeps for backward minus what the dense MLP the base plan counted keeps."""
    sb, h, fe = s * b, moe.dim, moe.moe_hidden
    rows = moe.top_k * sb * overload
    routed = (2 * rows * h * (2 if ep > 1 else 1) + 4 * rows * fe) * e
    router = 3 * sb * moe.n_experts * 4
    shared = 4 * sb * fe * moe.n_shared_experts * e
    dense = 4 * sb * moe.ffn_hidden * e
    return moe.moe_layers * (routed + router + shared - dense)


def apply_expert_parallel(
    row: dict[str, Any], strategy: str, moe: MoEShape, ep: int, num_params: int, overload: float,
    d: Any, alpha: float, beta: float, gpu_mem: float,
) -> dict[str, Any]:  # fmt: skip
    """Turn the plan ``row`` of the dense base layout into the plan of ``strategy`` at ``ep`` (see above).
    ``d``: the :class:`~paratrain.plan.memory.Dtypes`; ``alpha``, ``beta``: the ep group's link; ``gpu_mem``:
    bytes per GPU."""
    from paratrain.plan import memory as mem

    layout = row["layout"]
    n, tp, pp = layout["dp_replicate"] * layout["dp_shard"], layout["tp"], layout["pp"]
    stage_ranks = n * tp  # the ranks ep borrows from
    stage_layers = math.ceil(moe.moe_layers / pp)  # MoE layers of the busiest stage
    experts, dense = moe.expert_params, num_params - moe.expert_params
    stage_experts = experts * stage_layers / moe.moe_layers
    sharding = EP_STRATEGIES[strategy][1]
    by = dict(row["bytes_per_rank"])
    old_states = by["params"] + by["grads"] + by["optimizer"]
    if sharding == "none":  # ep: dense replicated, the experts divided by ep
        states = mem.model_states(dense + experts / ep, n, sharding, d)
        by.update(params=round(states.params), grads=round(states.grads), optimizer=round(states.optimizer))
        state_total = states.total
    else:  # FSDP shards dense and expert parameters alike over the stage's ranks: the base's states hold
        state_total = old_states
    b, s = row["micro_batch_size"], row["seq_len"]
    # this rank's routed tokens in a step (sequence-parallel under tp)
    tokens = s * b * row["microbatches"] * row["grad_accum"] / tp
    elements = moe.alltoall_elements(tokens, ep)  # per layer and direction
    sent = 2 * stage_layers * elements * d.compute  # forward and backward
    messages = 4 * stage_layers * (ep - 1) * row["microbatches"] * row["grad_accum"]
    a2a_time = sent * beta + messages * alpha
    out = dict(row)
    ratio = by["peak_reserved"] / by["peak"] if by.get("peak") else 1.0
    by["peak"] = round(by["peak"] - old_states + state_total)  # the MoE activations are the base plan's
    by["peak_reserved"] = round(by["peak"] * ratio)
    comm = dict(row["comm_bytes_per_rank_per_step"])
    if sharding == "none":  # the replicas' all-reduce carries the dense gradients and the experts' over edp
        for key in [k for k in comm if k.endswith("all_reduce")]:
            comm[key] = round(comm[key] * (dense + experts / ep * (n // ep > 1)) / num_params)
    comm["ep.all_to_all"] = round(sent)
    comm["total"] = sum(v for k, v in comm.items() if k != "total")
    time_s = dict(row["time_s"])
    time_s["ep_all_to_all"] = a2a_time
    time_s["total"] = time_s.get("total", row["step_time_s"]) + a2a_time
    step = row["step_time_s"] + a2a_time
    full = sharding == "full"
    out.update(
        strategy=strategy, bytes_per_rank=by, model_state_bytes_per_rank=round(state_total),
        comm_bytes_per_rank_per_step=comm, time_s=time_s, step_time_s=step,
        mfu=row["mfu"] * row["step_time_s"] / step if row.get("mfu") else row.get("mfu"),
        layout={**layout, "ep": ep},
        moe={
            "ep": ep, "edp": stage_ranks // ep,
            "expert_params_per_rank": stage_experts / ep / (stage_ranks // ep if full else 1),
            "dense_params_per_rank": dense / pp / (stage_ranks if full else 1),
            "alltoall_bytes_per_layer_per_direction": elements * d.compute, "moe_layers": moe.moe_layers,
            "moe_layers_on_stage": stage_layers, "overload": overload,
        },
    )  # fmt: skip
    out["fits"] = by["peak"] <= gpu_mem
    return out
