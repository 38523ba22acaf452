"""How :class:`~paratrain.models.llama.Llama` is split by tensor and pipeline parallelism.

The model says how it is split; the strategies in :mod:`paratrain.parallel.tensor` and
:mod:`paratrain.parallel.pipeline` apply the split. Two functions:

- :func:`tp_plan`: the Megatron-LM plan (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053) with
  sequence parallelism (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198), written as DTensor
  ``ParallelStyle``s keyed by module name for ``parallelize_module`` (the structure of torchtitan's Llama
  plan). In Megatron's notation, ``f`` is the identity in forward and an all-reduce in backward, ``g`` the
  reverse; sequence parallelism replaces each all-reduce ``g`` by a reduce-scatter and each ``f`` by an
  all-gather, so the norms run on ``1/tp`` of the sequence. Per block, forward::

      residual [b, s/tp, h] --attention_norm--> all-gather(s) --wq/wk/wv colwise (local heads)--> attention
        --wo rowwise--> reduce-scatter(s) --> + residual
      residual [b, s/tp, h] --ffn_norm--> all-gather(s) --w1/w3 colwise--> silu * --w2 rowwise-->
        reduce-scatter(s) --> + residual

  i.e. 2 all-gathers and 2 reduce-scatters of ``b*s*h`` elements per layer in forward (and the same in
  backward, mirrored). Without sequence parallelism the norms are replicated and ``wo``/``w2`` all-reduce.
  The embedding is sharded by vocabulary rows (each rank looks up the ids it owns, the partial sums are
  reduce-scattered along the sequence); the output head by vocabulary columns, its logits all-gathered, or
  kept sharded for a loss-parallel cross-entropy.
- :func:`pipeline_split`: one pipeline stage as a :class:`Llama` that keeps the stage's modules only
  (embedding on the first stage, norm and head on the last, whole blocks in between), under their
  original names, so checkpoints of every layout share one set of names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from paratrain.errors import ConfigError
from paratrain.models.llama import Llama, flops_per_token
from paratrain.models.spec import ModelSpec, register_model_spec
from paratrain.spec.moe import is_moe_layer

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "LLAMA_SPEC",
    "check_pipeline",
    "check_tensor_parallel",
    "pipeline_split",
    "split_layers",
    "tp_plan",
]


def check_tensor_parallel(model: Llama, tp: int, ranks: int | None = None) -> None:
    """Raise :class:`ConfigError` unless the heads (query and key/value) and the feed-forward width divide
    by the TP degree, and the embeddings are not tied. ``ranks``: the ranks left for ``tp`` (world / pp); the
    degrees the message suggests are the ones above 1 that divide them too (a tp preset refuses ``--tp 1``)."""
    cfg = model.config
    if cfg.n_heads % tp or cfg.n_kv_heads % tp:
        heads = [d for d in range(1, cfg.n_kv_heads + 1) if cfg.n_heads % d == 0 and cfg.n_kv_heads % d == 0]
        usable = [d for d in heads if d > 1 and (ranks is None or ranks % d == 0)]
        if usable:
            fix = f"Use --tp one of {', '.join(map(str, usable))}"
        elif len(heads) == 1:
            fix = "These heads cannot be split: use a data-parallel strategy (ddp, zero3)"
        else:
            fix = (
                f"No degree above 1 divides both the heads (divisors {', '.join(map(str, heads))}) and the "
                f"{ranks} ranks: run on a multiple of {heads[1]} ranks"
            )
        raise ConfigError(
            f"tensor parallel degree {tp} does not divide the heads of the model (model.n_heads={cfg.n_heads}, "
            f"model.n_kv_heads={cfg.n_kv_heads}): each rank computes whole heads. {fix}, or change the heads "
            "with --set model.n_heads=/model.n_kv_heads=."
        )
    if cfg.ffn_hidden % tp:
        raise ConfigError(
            f"tensor parallel degree {tp} does not divide the feed-forward width (model.ffn_hidden="
            f"{cfg.ffn_hidden}): each rank computes an equal slice of it. Use --set model.ffn_hidden= a "
            f"multiple of {tp}, or another --tp."
        )
    if cfg.tie_embeddings:
        raise ConfigError(
            "tensor parallelism shards the embedding by vocabulary rows and the output layer by columns, so "
            "the two cannot share one weight (model.tie_embeddings=true). Use --set model.tie_embeddings=false "
            "with tp, or a data-parallel strategy (ddp, zero3, ...) for a tied model."
        )


def tp_plan(
    model: Llama, sequence_parallel: bool = True, loss_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of ``model`` (or of a pipeline stage of it): ``{module name: style}``.

    Only modules present on ``model`` are named, so a pipeline stage gets the plan of its own layers.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    # The residual stream between blocks: sharded along the sequence (dim 1) with SP, replicated without.
    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        # Rows (vocabulary) sharded: each rank embeds the ids it owns, zeros elsewhere; the partial sums are
        # reduce-scattered along the sequence (SP) or all-reduced.
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    for key in model.layers:
        p = f"layers.{key}"
        if sequence_parallel:
            plan[f"{p}.attention_norm"] = SequenceParallel()
            plan[f"{p}.ffn_norm"] = SequenceParallel()
            # all-gather the normed sequence before the projections (Megatron's f with SP)
            plan[f"{p}.attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            )
            plan[f"{p}.feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        if is_moe_layer(model.config, int(key)):
            # An MoE block runs sequence-parallel: each tp rank routes its own s/tp tokens (plain tensors in and
            # out), its experts split by the expert-parallel strategy, its router and shared expert replicated
            # over tp (their gradients summed over tp by that strategy). Without SP it runs replicated.
            plan.pop(f"{p}.feed_forward", None)
            if sequence_parallel:
                plan[f"{p}.feed_forward"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
                )
            for name in ("attention.wq", "attention.wk", "attention.wv"):
                plan[f"{p}.{name}"] = ColwiseParallel()
            plan[f"{p}.attention.wo"] = RowwiseParallel(output_layouts=stream)
            continue
        # colwise: each rank computes its heads / its slice of the hidden width, with no communication
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        # rowwise: partial sums, reduce-scattered along the sequence (SP) or all-reduced (Megatron's g)
        plan[f"{p}.attention.wo"] = RowwiseParallel(output_layouts=stream)
        plan[f"{p}.feed_forward.w2"] = RowwiseParallel(output_layouts=stream)
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def split_layers(
    n_layers: int, num_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[list[str]]:
    """Layer keys of each stage: ``layers_per_stage`` when given (uneven splits), else as even as possible
    with the larger stages first (10 layers on 4 stages: 3, 3, 2, 2)."""
    if layers_per_stage is None:
        base, extra = divmod(n_layers, num_stages)
        layers_per_stage = [base + (1 if s < extra else 0) for s in range(num_stages)]
    counts = list(layers_per_stage)
    if len(counts) != num_stages or sum(counts) != n_layers or min(counts) < 1:
        raise ConfigError(
            f"pipeline split {counts}: give {num_stages} positive layer counts that sum to the model's "
            f"{n_layers} layers."
        )
    out, start = [], 0
    for c in counts:
        out.append([str(i) for i in range(start, start + c)])
        start += c
    return out


def check_pipeline(model: Llama, num_stages: int) -> None:
    """Raise :class:`ConfigError` unless ``model`` can be cut into ``num_stages`` stages of whole layers."""
    cfg = model.config
    if num_stages > cfg.n_layers:
        raise ConfigError(
            f"the pipeline has {num_stages} stages but the model has {cfg.n_layers} layers: every stage needs at "
            f"least one. Lower --pp (interleaved-1f1b puts 2 stages on each rank) or raise model.n_layers."
        )
    if cfg.tie_embeddings and num_stages > 1:
        raise ConfigError(
            "model.tie_embeddings=true shares one matrix between the embedding (first pipeline stage) and the "
            "output head (last stage), which live on different ranks. Use --set model.tie_embeddings=false "
            "with pipeline parallelism."
        )


def pipeline_split(
    model: Llama, num_stages: int, stage: int, layers_per_stage: Sequence[int] | None = None
) -> Llama:
    """Stage ``stage`` of ``num_stages``: a :class:`Llama` holding ``model``'s own modules for that stage.

    The embedding goes to stage 0, the final norm and the head to the last stage, the blocks are split by
    :func:`split_layers`. The stage *shares* its modules (and so its parameters) with ``model``: nothing is
    copied, and the names are the original ones (``layers.5.attention.wq.weight`` on every layout). The
    modules of other stages are absent (``None``, or missing from ``layers``); ``model`` itself is not
    changed. Layers already removed from ``model`` are fine as long as this stage's are present.
    """
    check_pipeline(model, num_stages)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    keys = split_layers(model.config.n_layers, num_stages, layers_per_stage)[stage]
    missing = [k for k in keys if k not in model.layers]
    first, last = stage == 0, stage == num_stages - 1
    if missing or (first and model.tok_embeddings is None) or (last and model.output is None):
        raise ValueError(f"stage {stage}'s modules are not on this model (layers {missing} missing?)")
    part = Llama.__new__(Llama)
    nn.Module.__init__(part)
    part.config = model.config
    part.tok_embeddings = model.tok_embeddings if first else None
    part.layers = nn.ModuleDict({k: model.layers[k] for k in keys})
    part.norm = model.norm if last else None
    part.output = model.output if last else None
    part.register_buffer("freqs_cos", model.freqs_cos, persistent=False)
    part.register_buffer("freqs_sin", model.freqs_sin, persistent=False)
    return part


def _stage_blocks(stage: nn.Module) -> list[nn.Module]:
    layers = getattr(stage, "layers", None)
    assert isinstance(layers, nn.ModuleDict), (
        "a Llama pipeline stage keeps its blocks in a ModuleDict `layers`"
    )
    return list(layers.values())


LLAMA_SPEC = register_model_spec(
    lambda m: isinstance(m, Llama),
    ModelSpec(
        family="llama",
        tp_plan=lambda m, sp, lp: tp_plan(m, sequence_parallel=sp, loss_parallel=lp),  # type: ignore[arg-type]
        check_tp=check_tensor_parallel,  # type: ignore[arg-type]
        pipeline_split=pipeline_split,  # type: ignore[arg-type]
        check_pipeline=check_pipeline,  # type: ignore[arg-type]
        stage_blocks=_stage_blocks,
        flops_per_token=lambda m, seq_len: flops_per_token(m.config, seq_len),  # type: ignore[arg-type]
    ),
)
"""paratrain's Llama: Megatron TP with sequence parallelism, whole-block pipeline stages."""
