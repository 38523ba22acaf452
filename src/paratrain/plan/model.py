"""What the planner knows about a model: its parameters by place, and its transformer shape if it has one.

Three ways in:

- a bare parameter count (``--params 7.5e9``): model states only, no activations, no TP/PP;
- a :class:`TransformerShape` (dim, n_layers, n_heads, n_kv_heads, ffn_hidden, vocab_size, max_seq_len: the
  field names of ``models.llama.LlamaConfig``), from which parameters are counted analytically;
- an ``nn.Module`` built on the meta device: parameters are counted exactly, by name. Each one is placed for
  pipeline parallelism (a block of ``model.blocks`` / ``model.layers``; an embedding — a name containing
  ``embed``, ``wte`` or ``wpe`` — on the first stage; everything else, final norm and output head, on the
  last) and for tensor parallelism (matrices, ndim ≥ 2 — attention and MLP weights, embedding, output — are
  split over tp; vectors — norms, biases — are replicated on every tp rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paratrain.errors import ConfigError
from paratrain.plan.profile import ActivationProfile

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ParamGroup:
    """Parameters held in one place: ``sharded`` elements split over tp, ``replicated`` kept whole."""

    sharded: int = 0
    replicated: int = 0

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def per_rank(self, tp: int) -> float:
        return self.sharded / tp + self.replicated

    def __add__(self, other: ParamGroup) -> ParamGroup:
        return ParamGroup(self.sharded + other.sharded, self.replicated + other.replicated)


@dataclass(frozen=True)
class TransformerShape:
    """A decoder's shape. ``arch="llama"``: RMSNorm, SwiGLU MLP of ``ffn_hidden``, GQA, RoPE, no biases, no
    dropout. ``arch="gpt"``: LayerNorm, GeLU MLP of ``ffn_hidden`` (4·dim), biases, dropout, learned positions,
    the output tied to the token embedding when ``tied_embeddings`` (GPT-3; Korthikanti et al.'s reference
    model)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    max_seq_len: int
    arch: str = "llama"
    tied_embeddings: bool = False
    attn_head_dim: int = 0
    """The width of one attention head where a config sets it apart from ``dim / n_heads`` (Qwen3, Mistral
    Nemo); 0: ``dim / n_heads``."""
    layer_extra: ParamGroup = field(default_factory=ParamGroup)
    """Per-layer parameters beyond the arch's formula (Hugging Face configs: q/k/v/o or MLP biases, Qwen3's
    per-head q/k norms), so that a config's count is exact."""
    norms: int = 2
    """Hidden-size-wide norms per layer (Llama: 2; Gemma 2: 4, before and after attention and the MLP)."""
    qk_norms: bool = False
    """Per-head norms of the queries and keys (Qwen3, Gemma 3): each keeps its input and output."""
    attention_softcap: bool = False
    """Attention scores soft-capped, ``cap * tanh(scores / cap)`` (Gemma 2): eager attention keeps the tanh too."""
    logit_softcap: bool = False
    """Logits soft-capped (Gemma 2's ``final_logit_softcapping``): one more logits-sized tensor kept (the tanh's
    output)."""
    gated_mlp: bool = True
    """``arch="llama"``: a gated MLP of three ``ffn_hidden``-wide matrices (SwiGLU, GeGLU); ``False``: two (an
    up and a down projection around the activation, as GPT-NeoX's, StarCoder2's or Arcee's)."""

    def __post_init__(self) -> None:
        for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"model shape: {f} must be a positive integer, got {v!r}.")
        if (self.dim % self.n_heads and not self.attn_head_dim) or self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model shape: dim {self.dim} must divide by n_heads {self.n_heads}, and n_heads by n_kv_heads "
                f"{self.n_kv_heads}."
            )
        if self.arch not in ("llama", "gpt"):
            raise ConfigError(f"model shape: arch must be 'llama' or 'gpt', got {self.arch!r}.")

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def mlp_matrices(self) -> int:
        """``ffn_hidden``-wide matrices of the MLP: 3 gated (Llama), 2 not (GPT)."""
        return 3 if self.gated_mlp and self.arch != "gpt" else 2

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer(self) -> ParamGroup:
        h, kv, f, q = self.dim, self.kv_dim, self.ffn_hidden, self.n_heads * self.head_dim
        if self.arch == "gpt":  # qkv (+bias), proj (+bias), fc1 (+bias), fc2 (+bias), 2 LayerNorms (w, b)
            base = ParamGroup(sharded=3 * h * h + h * h + 2 * h * f + 3 * h + f, replicated=h + h + 4 * h)
        else:  # wq wo wk wv w1 w2 (w3), 2 RMSNorms
            base = ParamGroup(sharded=2 * h * q + 2 * h * kv + self.mlp_matrices * h * f, replicated=2 * h)
        return base + self.layer_extra

    def embedding(self) -> ParamGroup:
        pos = self.max_seq_len * self.dim if self.arch == "gpt" else 0
        return ParamGroup(sharded=self.vocab_size * self.dim + pos)

    def head(self) -> ParamGroup:
        norm = 2 * self.dim if self.arch == "gpt" else self.dim
        out = 0 if self.tied_embeddings else self.vocab_size * self.dim
        return ParamGroup(sharded=out, replicated=norm)

    def num_params(self) -> int:
        return self.embedding().total + self.n_layers * self.layer().total + self.head().total


SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len")


def shape_from_config(config: Any, arch: str = "llama") -> TransformerShape | None:
    """A :class:`TransformerShape` from any object with ``dim``, ``n_layers``, ``n_heads``, ``vocab_size`` and
    ``max_seq_len`` (``n_kv_heads`` defaults to ``n_heads``; ``ffn_hidden``, when absent or None, to Meta's
    rule: 8·dim/3 × ``ffn_dim_multiplier``, rounded up to ``multiple_of``), else ``None``."""
    if config is None or not all(hasattr(config, f) for f in ("dim", "n_layers", "n_heads")):
        return None
    values: dict[str, Any] = {f: getattr(config, f, None) for f in SHAPE_FIELDS}
    if values["n_kv_heads"] is None:
        values["n_kv_heads"] = values["n_heads"]
    if values["ffn_hidden"] is None and isinstance(values["dim"], int):  # Meta's rule (llama/model.py)
        hidden = int(2 * 4 * values["dim"] / 3 * (getattr(config, "ffn_dim_multiplier", None) or 1.0))
        multiple = int(getattr(config, "multiple_of", 256) or 256)
        values["ffn_hidden"] = multiple * -(-hidden // multiple)
    missing = [f for f, v in values.items() if v is None]
    if missing:
        raise ConfigError(
            f"model config {type(config).__name__} lacks {', '.join(missing)} to plan a transformer."
        )
    tied = bool(getattr(config, "tie_embeddings", getattr(config, "tied_embeddings", False)))
    return TransformerShape(**values, arch=str(getattr(config, "arch", arch)), tied_embeddings=tied)


# Public shapes (Touvron et al. 2023, Llama 2 paper table 1 / Meta's params.json; Llama 3 model card; GPT-3:
# Brown et al. 2020 table 2.1). Used when models.llama is not importable; its PRESETS win when it is.
FALLBACK_SHAPES: dict[str, TransformerShape] = {
    "llama2-7b": TransformerShape(4096, 32, 32, 32, 11008, 32000, 4096),
    "llama2-13b": TransformerShape(5120, 40, 40, 40, 13824, 32000, 4096),
    "llama2-70b": TransformerShape(8192, 80, 64, 8, 28672, 32000, 4096),
    "llama3-8b": TransformerShape(4096, 32, 32, 8, 14336, 128256, 8192),
    "llama3-70b": TransformerShape(8192, 80, 64, 8, 28672, 128256, 8192),
    "gpt3-175b": TransformerShape(
        12288, 96, 96, 96, 4 * 12288, 50257, 2048, arch="gpt", tied_embeddings=True
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """The planner's description of a model."""

    name: str
    num_params: int
    shape: TransformerShape | None = None
    first: ParamGroup = field(default_factory=ParamGroup)
    """Parameters of the first pipeline stage only (embeddings)."""
    layers: tuple[ParamGroup, ...] = ()
    """One group per block / transformer layer, in order: the units of FSDP and of pipeline splits."""
    last: ParamGroup = field(default_factory=ParamGroup)
    """Parameters of the last stage (final norm, output head), and of models without blocks."""
    profile: ActivationProfile | None = None
    largest_tensor: ParamGroup = field(default_factory=ParamGroup)
    """The largest parameter tensor (sharded over tp if it is a matrix): the optimizer's per-tensor temporaries."""
    states_only: bool = False
    """A bare parameter count: model states only (no activations, buffers or TP/PP)."""
    moe: Any = None
    """A mixture-of-experts model's :class:`~paratrain.plan.moe.MoEShape` (``None``: dense)."""
    splits: tuple[str, ...] = ("tp", "pp", "ep")
    """The model-parallel axes paratrain can split this model along: a Hugging Face architecture without a
    tensor-parallel plan, a stage split or paratrain's MoE layers plans data-parallel layouts only."""
    arch: str = ""
    """A Hugging Face model's ``transformers`` class (the refusals name it); empty for paratrain's own."""
    attention: str = ""
    """The attention a Hugging Face architecture runs when ``transformers`` has no SDPA path for it (``"eager"``:
    Gemma 2, BLOOM, ...); empty: the workload's (``--attention``)."""
    embedding_units: bool = False
    """FSDP (zero3/hsdp) wraps ``first`` (the embedding) and ``last`` (final norm + head) as units of their own
    and leaves the root empty: Hugging Face models with untied embeddings
    (:func:`paratrain.parallel.fsdp.embedding_units`)."""

    @property
    def inactive_params(self) -> int:
        """MoE: the routed expert parameters a token does not run through (``n_experts - top_k`` per layer)."""
        m = self.moe
        return 0 if m is None else m.moe_layers * (m.n_experts - m.top_k) * 3 * m.dim * m.moe_hidden

    @property
    def matmul_params(self) -> int:
        """Parameters used in matmuls per token (for 6·N): all but the input embedding lookup, unless it is
        tied, and but the experts a token is not routed to."""
        if self.shape is None:
            return self.num_params - self.inactive_params
        if self.shape.arch == "gpt":  # learned positions (and an untied token embedding) are pure lookups
            untied = 0 if self.shape.tied_embeddings else self.shape.vocab_size * self.shape.dim
            return self.num_params - self.shape.max_seq_len * self.shape.dim - untied
        embedding = 0 if self.shape.tied_embeddings else self.first.total
        return self.num_params - embedding - self.inactive_params


def spec_from_params(num_params: float, name: str | None = None) -> ModelSpec:
    if not 1 <= num_params < 1e18:  # NaN and inf too
        raise ConfigError(f"--params must be a positive parameter count (below 1e18), got {num_params!r}.")
    n = int(num_params)
    return ModelSpec(
        name=name or f"{n:.3g} parameters", num_params=n, last=ParamGroup(replicated=n), states_only=True
    )


def spec_from_shape(shape: TransformerShape, name: str) -> ModelSpec:
    h, v = shape.dim, shape.vocab_size
    largest = max(v * h, shape.ffn_hidden * h, h * h, shape.max_seq_len * h if shape.arch == "gpt" else 0)
    return ModelSpec(
        name=name, num_params=shape.num_params(), shape=shape, first=shape.embedding(),
        layers=(shape.layer(),) * shape.n_layers, last=shape.head(), largest_tensor=ParamGroup(sharded=largest),
    )  # fmt: skip


def _blocks(module: nn.Module) -> list[nn.Module]:
    from torch import nn

    for attr in ("blocks", "layers"):
        blocks = getattr(module, attr, None)
        if isinstance(blocks, nn.ModuleList | nn.ModuleDict):
            return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    return []


def spec_from_module(
    module: nn.Module,
    name: str,
    shape: TransformerShape | None = None,
    input_shape: tuple[int, ...] | None = None,
) -> ModelSpec:
    """Exact parameter counts by name; a non-transformer on the meta device with ``input_shape`` is traced."""
    blocks = _blocks(module)
    where = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    per_block = [ParamGroup() for _ in blocks]
    first, last, largest, total = ParamGroup(), ParamGroup(), ParamGroup(), 0
    for pname, p in module.named_parameters():
        n = p.numel()
        total += n
        g = ParamGroup(sharded=n) if p.dim() >= 2 else ParamGroup(replicated=n)
        largest = g if n > largest.total else largest
        if id(p) in where:
            per_block[where[id(p)]] += g
        elif any(k in pname.lower() for k in ("embed", "wte", "wpe")):
            first += g
        else:
            last += g
    profile = None
    if (
        shape is None
        and input_shape is not None
        and all(p.device.type == "meta" for p in module.parameters())
    ):
        from paratrain.plan.trace import profile_module

        profile = profile_module(module, blocks, input_shape)
    return ModelSpec(name=name, num_params=total, shape=shape, first=first, layers=tuple(per_block), last=last,
                     profile=profile, largest_tensor=largest)  # fmt: skip
