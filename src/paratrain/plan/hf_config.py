"""The shape of a Hugging Face model from its ``config.json`` alone: ``paratrain plan --model hf:DIR``.

No weights, no ``transformers``, no torch: the JSON is read here and mapped onto
:class:`~paratrain.plan.model.TransformerShape`, so a Llama 3 405B or any other published dense decoder can
be planned on a laptop. Llama, Qwen2/Qwen3 and Mistral map to ``arch="llama"`` (RMSNorm, SwiGLU MLP of
``intermediate_size``, grouped-query attention, rotary positions); GPT-2 to ``arch="gpt"`` (LayerNorm, GeLU
MLP of ``n_inner`` or 4·``n_embd``, biases, learned positions, head tied unless ``tie_word_embeddings`` is
false). The parameter count is ``transformers``' exactly: an explicit ``head_dim`` (Qwen3, Mistral Nemo) sets
the attention width, and Qwen2's q/k/v biases, Llama's ``attention_bias``/``mlp_bias`` and Qwen3's per-head
q/k norms are counted per layer.

Any other ``model_type`` ``transformers`` knows is built on the meta device instead (:func:`meta_spec`): its
parameters exact by place, its activations those of a Llama layer of its widths.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.plan.model import ModelSpec, ParamGroup, TransformerShape, spec_from_shape

__all__ = [
    "LLAMA_LIKE", "MOE_TYPES", "hf_config_path", "meta_spec", "shape_from_hf_config", "spec_from_hf_config",
]  # fmt: skip

LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mistral")
"""``model_type`` values planned as ``arch="llama"``."""
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Mixture-of-experts ``model_type`` values: a Llama-like attention, and routed experts (SwiGLU) in place of the
MLP of every layer (Mixtral) or of every ``decoder_sparse_step``-th layer outside ``mlp_only_layers`` (Qwen2-MoE,
with a gated shared expert, and Qwen3-MoE). paratrain trains them under its data-parallel strategies."""


def hf_config_path(name: str) -> Path | None:
    """The ``config.json`` named by ``--model``: ``hf:DIR``, a directory holding one, or the file itself;
    ``None`` when ``name`` is not such a reference (a registry name)."""
    if name.startswith("hf:"):
        p = Path(name[3:]).expanduser()
    elif name.endswith(".json"):
        p = Path(name).expanduser()
    else:
        return None
    path = p / "config.json" if p.is_dir() else p
    if not path.is_file():
        raise ConfigError(
            f"--model {name}: {path} does not exist. Give hf:DIR with a Hugging Face config.json in DIR, or the "
            "path of a config.json."
        )
    return path


def _get(cfg: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def _read(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON config ({e}).") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: not a Hugging Face config (a JSON object).")
    return cfg


def shape_from_hf_config(path: Path) -> TransformerShape:
    """The :class:`TransformerShape` of the ``config.json`` at ``path`` (refused, naming it, when the model
    type is not a decoder the planner models). For a mixture of experts, the shape of its dense skeleton:
    ``ffn_hidden`` is ``intermediate_size`` (:func:`spec_from_hf_config` adds the experts)."""
    cfg = _read(path)
    kind = str(cfg.get("model_type", ""))
    if kind == "gpt2":
        dim = int(cfg["n_embd"])
        return TransformerShape(
            dim=dim, n_layers=int(cfg["n_layer"]), n_heads=int(cfg["n_head"]), n_kv_heads=int(cfg["n_head"]),
            ffn_hidden=int(cfg.get("n_inner") or 4 * dim), vocab_size=int(cfg["vocab_size"]),
            max_seq_len=int(cfg.get("n_positions") or 1024), arch="gpt",
            tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )  # fmt: skip
    if kind not in LLAMA_LIKE + MOE_TYPES:
        raise ConfigError(
            f"{path}: model_type {kind!r} is not one the planner reads from the JSON alone (dense "
            f"{', '.join(LLAMA_LIKE)} and gpt2; the mixtures of experts {', '.join(MOE_TYPES)}); "
            "spec_from_hf_config builds any other transformers causal LM on the meta device."
        )
    try:
        heads, dim = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        kv, ffn = int(_get(cfg, "num_key_value_heads") or heads), int(cfg["intermediate_size"])
        head_dim = int(_get(cfg, "head_dim") or dim // heads)
        return TransformerShape(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn,
            vocab_size=int(cfg["vocab_size"]), max_seq_len=int(_get(cfg, "max_position_embeddings") or 4096),
            arch="llama", tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_head_dim=head_dim if head_dim * heads != dim else 0, qk_norms=kind in ("qwen3", "qwen3_moe"),
            layer_extra=_layer_extra(kind, cfg, dim, heads * head_dim, kv * head_dim, head_dim, ffn),
        )  # fmt: skip
    except KeyError as e:
        raise ConfigError(f"{path}: the config has no {e.args[0]!r}, which the shape needs.") from None


def _layer_extra(
    kind: str, cfg: dict[str, Any], h: int, q: int, kv: int, head_dim: int, ffn: int
) -> ParamGroup:
    """The parameters of one layer beyond the bias-free Llama formula, as ``transformers`` builds them:
    Qwen2 always has q/k/v biases; Llama and Qwen3 have q/k/v/o biases with ``attention_bias`` and Llama
    gate/up/down biases with ``mlp_bias``; Qwen3 has an RMSNorm over ``head_dim`` for q and one for k.
    Biases of column-split layers are split over tp, the rest replicated."""
    extra = ParamGroup()
    if kind == "qwen2" or (kind == "qwen2_moe" and cfg.get("qkv_bias", True)):
        extra += ParamGroup(sharded=q + 2 * kv)
    elif kind in ("llama", "qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        extra += ParamGroup(sharded=q + 2 * kv, replicated=h)
    if kind == "llama" and cfg.get("mlp_bias"):
        extra += ParamGroup(sharded=2 * ffn, replicated=h)
    if kind in ("qwen3", "qwen3_moe"):
        extra += ParamGroup(replicated=2 * head_dim)
    return extra


def _moe_layers(kind: str, cfg: dict[str, Any], n_layers: int) -> list[bool]:
    """Which layers route to experts, as ``transformers`` builds them."""
    if kind == "mixtral":
        return [True] * n_layers
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    experts = int(_get(cfg, "num_local_experts", "num_experts") or 0)
    return [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n_layers)]


def _moe_spec(path: Path, cfg: dict[str, Any], shape: TransformerShape, name: str) -> ModelSpec:
    """A mixture of experts: each MoE layer's router (``experts x dim``), its experts' stacked SwiGLU matrices
    (``3 x experts x dim x moe_hidden``) and Qwen2-MoE's shared expert and its one-output gate in place of the
    dense MLP; the rest as the dense skeleton's."""
    from paratrain.plan.moe import MoEShape

    kind, h = str(cfg["model_type"]), shape.dim
    try:
        # the published configs write num_experts for Qwen; transformers 5 saves num_local_experts for all three
        experts = int(_get(cfg, "num_local_experts", "num_experts") or cfg["num_experts"])
        fe = int(cfg["intermediate_size"] if kind == "mixtral" else cfg["moe_intermediate_size"])
        top_k = int(cfg["num_experts_per_tok"])
    except KeyError as e:
        raise ConfigError(
            f"{path}: the config has no {e.args[0]!r}, which a mixture of experts needs."
        ) from None
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
    routed = _moe_layers(kind, cfg, shape.n_layers)
    if not any(routed):
        raise ConfigError(
            f"{path}: the config routes no layer to experts (num_experts, decoder_sparse_step)."
        )
    dense = spec_from_shape(shape, name)
    swap = (
        experts * h + 3 * experts * h * fe + 3 * h * shared + (h if shared else 0) - 3 * h * shape.ffn_hidden
    )
    layers = tuple(
        ParamGroup(g.sharded + swap, g.replicated) if r else g
        for g, r in zip(dense.layers, routed, strict=True)
    )
    total = dense.first.total + sum(g.total for g in layers) + dense.last.total
    expert_matrix = ParamGroup(sharded=2 * fe * h * experts)  # the stacked gate_up_proj
    largest = max(dense.largest_tensor, expert_matrix, key=lambda g: g.total)
    shape_moe = MoEShape(dim=h, n_experts=experts, top_k=top_k, n_shared_experts=shared / fe, moe_hidden=fe,
                         moe_layers=sum(routed), ffn_hidden=shape.ffn_hidden)  # fmt: skip
    arch = {
        "mixtral": "MixtralForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
    }
    return replace(dense, num_params=total, layers=layers, largest_tensor=largest, moe=shape_moe, splits=(),
                   arch=arch[kind])  # fmt: skip


def spec_from_hf_config(path: Path, name: str, model: Any = None) -> ModelSpec:
    """The planner's spec of the ``config.json`` at ``path``: its shape, and, with untied embeddings, the
    embedding and the final norm + head as FSDP units of their own (as zero3/hsdp wrap an HF model). A model
    type outside :data:`LLAMA_LIKE`, gpt2 and :data:`MOE_TYPES` is built on the meta device
    (:func:`meta_spec`), or read from ``model`` when the caller has built it."""
    cfg = _read(path)
    if str(cfg.get("model_type", "")) not in ("gpt2", *LLAMA_LIKE, *MOE_TYPES):
        return meta_spec(path, cfg, name, model)
    shape = shape_from_hf_config(path)
    spec = (
        _moe_spec(path, cfg, shape, name)
        if cfg.get("model_type") in MOE_TYPES
        else spec_from_shape(shape, name)
    )
    return replace(spec, embedding_units=not shape.tied_embeddings)


TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_k", "router_top_k")
"""Config keys that name the experts a token is routed to, across ``transformers``' MoE architectures."""
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config keys that name the routed experts of an MoE layer."""
GATED_NAMES = ("gate_proj", "gate_up_proj", "w3", "wi_0", "gate_up")
"""Parameter names of a gated MLP's gate (SwiGLU, GeGLU): an MLP without one has two matrices."""


def _text_config(config: Any) -> Any:
    """The language model's config of a composite (vision-language) config, else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _build_meta(path: Path, kind: str) -> Any:
    """``transformers``' causal LM of the config at ``path``, built on the meta device (no weights)."""
    try:
        import torch
        import transformers
        from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - both are paratrain dependencies
        raise ConfigError(
            f"{path}: model_type {kind!r} is planned from a meta build, which needs {e.name}."
        ) from None
    if kind not in CONFIG_MAPPING:
        raise ConfigError(
            f"{path}: model_type {kind!r} is not one transformers {transformers.__version__} knows (custom code "
            "is not run). Plan it with --params N (states only), or give the config of a known architecture."
        )
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        config = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers' own checks of the config (AssertionError, ValueError, ...)
        raise ConfigError(
            f"{path}: transformers could not build a causal LM of model_type {kind!r} from it ({e}). Plan it with "
            "--params N (states only)."
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def _first_int(cfg: Any, *keys: str) -> int | None:
    for k in keys:
        try:
            v = getattr(cfg, k, None)
        except Exception:  # a per-layer attribute that has no one value (Gemma 4's head_dim)
            v = None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _meta_moe(blocks: list[Any], text: Any, dim: int, ffn: int, path: Path) -> Any:
    """The :class:`~paratrain.plan.moe.MoEShape` of a meta-built model whose layers hold experts (parameters
    under an ``experts`` module), else ``None``: the experts' count and ``top_k`` from the config, their width
    from their parameters (three ``dim x moe_hidden`` matrices each, as the planner models an expert), the
    shared experts from the parameters under a ``shared_expert(s)`` module."""
    from paratrain.plan.moe import MoEShape

    routed, shared, moe_layers = 0, 0, 0
    for b in blocks:
        names = [(n, p.numel()) for n, p in b.named_parameters()]
        experts = sum(k for n, k in names if ".experts." in f".{n}")
        if experts:
            moe_layers += 1
            routed += experts
            shared += sum(
                k for n, k in names if "shared_expert" in n and "gate." not in n.split("shared_expert")[-1]
            )
    if not moe_layers:
        return None
    n_experts = _first_int(text, *EXPERT_KEYS)
    top_k = _first_int(text, *TOP_K_KEYS)
    if n_experts is None or top_k is None:
        raise ConfigError(
            f"{path}: its layers hold experts, but the config names no expert count ({', '.join(EXPERT_KEYS)}) or "
            f"no experts per token ({', '.join(TOP_K_KEYS)}); add them to plan it."
        )
    moe_hidden = max(1, round(routed / moe_layers / (3 * n_experts * dim)))
    return MoEShape(dim=dim, n_experts=n_experts, top_k=top_k, n_shared_experts=shared / moe_layers / (3 * dim * moe_hidden),
                    moe_hidden=moe_hidden, moe_layers=moe_layers, ffn_hidden=ffn)  # fmt: skip


def meta_spec(path: Path, cfg: dict[str, Any], name: str, model: Any = None) -> ModelSpec:
    """Any other decoder ``transformers`` builds (Gemma, Phi-3, OLMo, GPT-NeoX, StarCoder2, DeepSeek-V3, ...;
    a vision-language model's language model): ``AutoModelForCausalLM.from_config`` on the meta device, its
    parameters counted exactly by place: each layer of the decoder's layer list (``models.hf_arch.decoder_layers``,
    the list ``train`` shards) is an FSDP unit and a pipeline slice; the parameters registered before the first layer (the embeddings, a vision tower) go with the first
    stage, those after the last (the final norm, the head) with the last. Matrices split over tp, vectors are
    replicated. The activations and the width model use a Llama layer of the config's widths (``hidden_size``,
    heads, KV heads, ``head_dim``, ``intermediate_size``; gated or not as its MLP is): an approximation for
    architectures whose layers differ (extra norms, dropout, sliding windows, MLA, linear attention). The model
    plans data-parallel layouts only, as ``train`` runs it; an MoE model's experts (:func:`_meta_moe`) count
    as routed experts. ``model``: the same model already built (the launch guard's), else it is built here."""
    kind = str(cfg.get("model_type", ""))
    model = model if model is not None else _build_meta(path, kind)
    text = _text_config(model.config)
    dim = _first_int(text, "hidden_size", "n_embd", "d_model")
    n_layers = _first_int(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first_int(text, "num_attention_heads", "n_head", "num_heads")
    if dim is None or n_layers is None or heads is None:
        missing = [
            k
            for k, v in (
                ("hidden_size", dim),
                ("num_hidden_layers", n_layers),
                ("num_attention_heads", heads),
            )
            if v is None
        ]
        raise ConfigError(
            f"{path}: the config names no {', '.join(missing)} ({type(model).__name__} is not an attention decoder "
            "the planner models by layer). Plan it with --params N (states only)."
        )
    from paratrain.models.hf_arch import architecture, decoder_layers

    blocks = [b for b in decoder_layers(model) if b is not None]  # the list train shards block by block
    n_layers = len(blocks)
    per_block = [ParamGroup() for _ in blocks]
    where = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    first, last, largest, total, seen_block = ParamGroup(), ParamGroup(), ParamGroup(), 0, False
    for _, p in model.named_parameters():
        g = ParamGroup(sharded=p.numel()) if p.dim() >= 2 else ParamGroup(replicated=p.numel())
        total += p.numel()
        largest = g if g.total > largest.total else largest
        seen_block = seen_block or id(p) in where
        if id(p) in where:
            per_block[where[id(p)]] += g
        elif seen_block:
            last += g
        else:
            first += g
    arch = architecture(model)  # the transformers class, also of the launch guard's swapped subclass
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out is not None and inp is not None and out.weight is inp.weight
    qk_dim = (_first_int(text, "qk_nope_head_dim") or 0) + (_first_int(text, "qk_rope_head_dim") or 0)  # MLA
    head_dim = qk_dim or _first_int(text, "head_dim") or dim // heads
    kv = _first_int(text, "num_key_value_heads", "num_kv_heads", "n_head_kv") or heads
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv = 1  # Falcon's multi-query attention
    kv = kv if heads % kv == 0 else heads
    ffn = _first_int(text, "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size") or 4 * dim
    moe = _meta_moe(blocks, text, dim, ffn, path)
    # an MoE model's experts are planned gated (three matrices), and so is the dense MLP they replace
    gated = moe is not None or any(
        g in n for b in blocks for n, _ in b.named_parameters() for g in GATED_NAMES
    )
    widths = [getattr(m, "weight", None) for m in blocks[0].modules() if "norm" in type(m).__name__.lower()]
    widths = [w.numel() for w in widths if w is not None]
    norms = widths.count(dim)
    shape = TransformerShape(
        dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn, norms=norms or 2,
        qk_norms=head_dim != dim and widths.count(head_dim) >= 2,
        attention_softcap=getattr(text, "attn_logit_softcapping", None) is not None,
        logit_softcap=getattr(text, "final_logit_softcapping", None) is not None,
        vocab_size=_first_int(text, "vocab_size") or 1,
        max_seq_len=_first_int(text, "max_position_embeddings", "n_positions", "seq_length", "max_seq_len") or 4096,
        tied_embeddings=tied, attn_head_dim=head_dim if head_dim * heads != dim else 0, gated_mlp=gated,
    )  # fmt: skip
    return ModelSpec(
        name=name, num_params=total, shape=shape, first=first, layers=tuple(per_block), last=last,
        largest_tensor=largest, moe=moe, splits=(), arch=arch, embedding_units=not tied,
        attention="" if getattr(model, "_supports_sdpa", True) else "eager",
    )  # fmt: skip
