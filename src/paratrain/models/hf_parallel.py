"""How ``transformers`` models are split by tensor and pipeline parallelism (``--model hf:DIR``).

**Tensor parallel plan** (Llama, Qwen2, Qwen3, Mistral, GPT-2): the config's own ``base_model_tp_plan``
(``layers.*.self_attn.q_proj: colwise``, ``o_proj: rowwise``, Qwen3's ``q_norm: replicated_with_grad_allreduce``,
...), or GPT-2's (which has none: :data:`_GPT2_PLAN`), translated into ``ParallelStyle``s (DTensor's, and
:mod:`paratrain.models.hf_tp`'s for what those do not cover) keyed by the module names of this model, plus the two ends: the input embedding sharded by vocabulary rows and the head by
vocabulary columns (its logits all-gathered, or kept sharded for a loss-parallel cross-entropy). It is
Megatron-LM's plan without sequence parallelism (the residual stream stays replicated, so Hugging Face's own
forward runs unchanged on the local heads): per decoder layer, forward, one all-reduce after ``o_proj`` and
one after ``down_proj``; backward, the mirror (the all-reduces move to the inputs of the colwise layers).
A tied embedding and head stay replicated (they could not be sharded two ways at once).

**Pipeline stages** (Llama, Qwen2, Qwen3, Mistral, GPT-2): a stage is a small module over the model's own
submodules: the embeddings on the first stage, whole decoder layers in between, the final norm and the head
on the last. Its ``forward`` repeats what the base model's forward does around the layers (positions,
rotary embeddings, the causal mask), so the stages chained give Hugging Face's logits. The model the
trainer holds keeps its original names (``model.layers.5...``) in every layout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.models.hf_arch import architecture, decoder_layers
from paratrain.models.hf_tp import Conv1DColwise, Conv1DRowwise, GPT2FusedQKV, GradAllReduce
from paratrain.models.llama_parallel import split_layers
from paratrain.spec.capabilities import hf_no_pp, hf_no_tp

__all__ = [
    "check_pipeline",
    "check_tp",
    "pipeline_split",
    "refuse_pp",
    "refuse_tp",
    "stage_blocks",
    "tp_plan",
]


def _heads(config: Any) -> tuple[int, int, int]:
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    ffn = int(getattr(config, "intermediate_size", 0) or 0)
    if getattr(config, "model_type", "") == "gpt2":  # n_inner, else 4 * hidden
        ffn = int(getattr(config, "n_inner", None) or 4 * int(config.hidden_size))
    return heads, kv, ffn


def _tied(model: nn.Module) -> bool:
    head = model.get_output_embeddings()  # type: ignore[operator]
    emb = model.get_input_embeddings()  # type: ignore[operator]
    return bool(getattr(model.config, "tie_word_embeddings", False)) or (
        head is not None and emb is not None and head.weight is emb.weight
    )


def check_tp(model: nn.Module, tp: int, ranks: int | None = None) -> None:
    """Heads (query and key/value) and the MLP width must divide by ``tp``: each rank computes whole heads."""
    heads, kv, ffn = _heads(model.config)
    if heads % tp or kv % tp or (ffn and ffn % tp):
        ok = [d for d in range(2, kv + 1) if heads % d == 0 and kv % d == 0 and (not ffn or ffn % d == 0)]
        ok = [d for d in ok if ranks is None or ranks % d == 0]
        fix = (
            f"Use --tp one of {', '.join(map(str, ok))}"
            if ok
            else "Use a data-parallel strategy (ddp, zero3)"
        )
        raise ConfigError(
            f"tensor parallel degree {tp} does not divide the heads of {architecture(model)} "
            f"(num_attention_heads={heads}, num_key_value_heads={kv}, intermediate_size={ffn}): each rank "
            f"computes whole heads and an equal slice of the MLP. {fix}."
        )


def refuse_tp(model: nn.Module, tp: int, ranks: int | None = None) -> None:
    """Tensor parallelism of an architecture without a plan here: refused, naming both."""
    raise ConfigError(hf_no_tp(architecture(model), tp, _can_pipeline(model)))


def refuse_pp(model: nn.Module, num_stages: int) -> None:
    """Pipeline parallelism of an architecture without a stage split here: refused, naming both."""
    raise ConfigError(hf_no_pp(architecture(model)))


def _can_pipeline(model: nn.Module) -> bool:
    from paratrain.models.hf_arch import PP_ARCHITECTURES

    return architecture(model) in PP_ARCHITECTURES


def _style(kind: str, arch: str, key: str) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    custom: dict[str, type[Conv1DColwise | Conv1DRowwise | GPT2FusedQKV]] = {
        "gpt2_attention": GPT2FusedQKV,
        "conv1d_colwise": Conv1DColwise,
        "conv1d_rowwise": Conv1DRowwise,
    }
    if kind in custom:
        return custom[kind]()
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel()
    if kind == "replicated_with_grad_allreduce":
        return GradAllReduce()
    raise ConfigError(
        f"{arch}'s tensor-parallel plan has {key!r}: {kind!r}, which paratrain does not translate (it takes "
        "colwise, rowwise and replicated_with_grad_allreduce). Use a data-parallel strategy (ddp, zero3, hsdp) or pp for this model."
    )


_GPT2_PLAN = {
    "h.*.attn": "gpt2_attention",
    "h.*.mlp.c_fc": "conv1d_colwise",
    "h.*.mlp.c_proj": "conv1d_rowwise",
}
"""GPT-2 has no ``base_model_tp_plan``: its fused q/k/v and ``Conv1D`` layers take the styles of
:mod:`paratrain.models.hf_tp` (Megatron's split, as for Llama)."""


def tp_plan(model: nn.Module, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, Any]:
    """``{module name: ParallelStyle}`` for the modules present on ``model`` (a pipeline rank keeps only its
    stages' modules). ``sequence_parallel`` is not applied (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    arch = architecture(model)
    base_plan = getattr(model.config, "base_model_tp_plan", None) or {}
    if arch == "GPT2LMHeadModel":
        base_plan = _GPT2_PLAN
    prefix = str(getattr(model, "base_model_prefix", "model"))
    patterns = [
        (re.compile("^" + re.escape(f"{prefix}.{key}").replace(r"\*", r"\d+") + "$"), kind, key)
        for key, kind in base_plan.items()
    ]
    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        for rx, kind, key in patterns:
            if module is not None and rx.match(name):
                plan[name] = _style(kind, arch, key)
    if not _tied(model):
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
        names = {id(m): n for n, m in model.named_modules()}
        if emb is not None and id(emb) in names:
            plan[names[id(emb)]] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if head is not None and id(head) in names:
            plan[names[id(head)]] = ColwiseParallel(
                output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
            )
    return plan


# ---- pipeline stages ---------------------------------------------------------------------------------------
def _num_layers(model: nn.Module) -> int:
    c: Any = model.config
    n: Any = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", 0)
    return int(n)


def check_pipeline(model: nn.Module, num_stages: int) -> None:
    """Every stage needs a whole layer. A tied embedding and head is held by the first and the last stage's
    ranks, which sum its two gradients (:mod:`paratrain.parallel.pipeline`)."""
    n = _num_layers(model)
    if num_stages > n:
        raise ConfigError(
            f"the pipeline has {num_stages} stages but {architecture(model)} has {n} layers: every stage needs at "
            "least one. Lower --pp."
        )


class _Stage(nn.Module):
    """One pipeline stage: ``forward(input_ids or hidden) -> hidden or logits`` over the model's modules."""

    embed: Any
    wpe: Any
    drop: Any
    norm: Any
    lm_head: Any
    rotary: Any

    def __init__(self, model: Any, keys: list[str], first: bool, last: bool) -> None:
        super().__init__()
        object.__setattr__(self, "config", model.config)
        self.arch = architecture(model)
        self.gpt2 = self.arch == "GPT2LMHeadModel"
        base = model.transformer if self.gpt2 else model.model
        layers = base.h if self.gpt2 else base.layers
        self.first, self.last = first, last
        self.embed = (base.wte if self.gpt2 else base.embed_tokens) if first else None
        # modules without parameters (rotary tables, dropout) are pruned from a pipeline rank's model with the
        # other stages' modules: the first split (before pruning) keeps them for the later ones
        stash = model.__dict__.setdefault("_paratrain_stage_stash", {})
        for key in ("rotary_emb", "drop"):
            if getattr(base, key, None) is not None:
                stash[key] = getattr(base, key)
        self.wpe = base.wpe if first and self.gpt2 else None
        self.drop = stash["drop"] if first and self.gpt2 else None
        self.layers = nn.ModuleDict({k: layers[int(k)] for k in keys})
        self.norm = (base.ln_f if self.gpt2 else base.norm) if last else None
        self.lm_head = model.lm_head if last else None
        rotary = None if self.gpt2 else stash["rotary_emb"]
        object.__setattr__(self, "rotary", rotary)  # buffers only: not a submodule of the stage

    def _masks(self, h: torch.Tensor, pos: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kw = {"config": self.config, "inputs_embeds": h, "attention_mask": None, "cache": None,
              "position_ids": pos}  # fmt: skip
        types = set(getattr(self.config, "layer_types", None) or ())
        sliding = self.arch == "MistralForCausalLM" and getattr(self.config, "sliding_window", None)
        masks = {
            "full_attention": (create_sliding_window_causal_mask if sliding else create_causal_mask)(**kw)
        }
        if "sliding_attention" in types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        return masks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if self.gpt2:
            if self.wpe is not None:
                h = self.drop(h + self.wpe(pos))
            for layer in self.layers.values():
                h = layer(h, None, None, position_ids=pos)
        else:
            masks = self._masks(h, pos)
            if self.rotary.inv_freq.device != h.device:
                self.rotary.to(h.device)
            pe = self.rotary(h, pos)
            types = getattr(self.config, "layer_types", None)
            for key, layer in self.layers.items():
                kind = types[int(key)] if types else "full_attention"
                h = layer(h, attention_mask=masks[kind], position_embeddings=pe, position_ids=pos)
        if self.last:
            h = self.lm_head(self.norm(h))
        return h


def pipeline_split(
    model: nn.Module, num_stages: int, stage: int, layers_per_stage: Sequence[int] | None = None
) -> nn.Module:
    """Stage ``stage`` of ``num_stages`` over ``model``'s own modules (shared, not copied)."""
    check_pipeline(model, num_stages)
    keys = split_layers(_num_layers(model), num_stages, layers_per_stage)[stage]
    layers = decoder_layers(model)
    missing = [k for k in keys if int(k) >= len(layers) or layers[int(k)] is None]
    if missing:
        raise ValueError(f"stage {stage}'s layers {missing} are not on this model")
    return _Stage(model, keys, stage == 0, stage == num_stages - 1)


def stage_blocks(stage: nn.Module) -> list[nn.Module]:
    layers = getattr(stage, "layers", None)
    assert isinstance(layers, nn.ModuleDict), "an hf pipeline stage keeps its layers in a ModuleDict"
    return list(layers.values())
