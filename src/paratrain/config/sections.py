"""The config sections of the model, the data, the strategy and the optimizer: one dataclass each,
a docstring under every field, checks in ``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.fields import (
    COMM_ALGORITHMS,
    check_choices,
    check_positive,
    check_range,
    choice,
    option,
)
from paratrain.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = option("cnn", flag="--model")
    """Model from the model registry (``mlp``, ``cnn``, ``resnet18``, ...; ``paratrain models`` lists them), or
    your own factory ``pkg.module:function`` (docs/python-api.md)."""
    hidden: int = 128
    """Hidden width of ``mlp`` layers."""
    layers: int = 2
    """Number of hidden layers (``mlp``)."""
    channels: int = 32
    """Channels of the first convolution (``cnn``); later blocks double it."""
    dropout: float = 0.0
    """Dropout probability before the classifier head."""
    batchnorm: bool = False
    """Use BatchNorm after each convolution of ``cnn``."""
    dim: int | None = None
    """Llama models: hidden size (``None``: the preset's)."""
    n_layers: int | None = None
    """Llama models: transformer blocks (``None``: the preset's)."""
    n_heads: int | None = None
    """Llama models: attention heads (``None``: the preset's); must divide by ``--tp``."""
    n_kv_heads: int | None = None
    """Llama models: key/value heads of grouped-query attention (``None``: the preset's)."""
    ffn_hidden: int | None = None
    """Llama models: hidden size of the SwiGLU MLP (``None``: the preset's)."""
    vocab_size: int | None = None
    """Llama models: vocabulary (``None``: the tokenizer's)."""
    max_seq_len: int | None = None
    """Llama models: longest sequence the rotary tables cover (``None``: the preset's, or ``--seq-len``)."""
    tie_embeddings: bool | None = None
    """Llama models: share the input embedding and the output head (``None``: the preset's)."""
    n_experts: int | None = None
    """Llama models: routed experts per MoE layer, 0 for a dense model (``None``: the preset's)."""
    top_k: int | None = None
    """Llama MoE: experts each token is routed to (``None``: the preset's)."""
    n_shared_experts: int | None = None
    """Llama MoE: always-on shared experts (``None``: the preset's)."""
    moe_every: int | None = None
    """Llama MoE: an MoE feed-forward in every k-th layer, dense elsewhere (``None``: the preset's)."""
    first_dense_layers: int | None = None
    """Llama MoE: leading dense layers before the first MoE one (``None``: the preset's)."""
    moe_hidden: int | None = None
    """Llama MoE: hidden width of each expert, 0 for ``ffn_hidden`` (``None``: the preset's)."""
    capacity_factor: float | None = None
    """Llama MoE: 0 is dropless; otherwise tokens past ``capacity_factor * tokens * top_k / n_experts`` per
    expert are dropped (``None``: the preset's)."""
    router_score: str | None = None
    """Llama MoE: ``softmax`` or ``sigmoid`` router scores (``None``: the preset's)."""
    router_renorm: bool | None = None
    """Llama MoE: renormalise the chosen experts' weights to sum to 1 (``None``: the preset's)."""
    aux_loss_coef: float | None = None
    """Llama MoE: coefficient of the sequence-level balance loss, 0 for none (``None``: the preset's)."""
    bias_update_rate: float | None = None
    """Llama MoE: step of the auxiliary-loss-free expert bias per optimizer step (``None``: the preset's)."""
    init_from: str | None = option(None, flag="--init-from", metavar="hf:DIR")
    """Llama models: start from the weights of a Hugging Face ``LlamaForCausalLM`` directory of the same shape
    (names mapped and rotary rows permuted; ``--model hf:DIR`` loads its own weights instead)."""

    def __post_init__(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            check_positive("model", key, getattr(self, key), allow_none=True)
        check_positive("model", "hidden", self.hidden)
        check_positive("model", "layers", self.layers)
        check_positive("model", "channels", self.channels)
        check_range("model", "dropout", self.dropout, 0.0, 1.0, hi_open=True)


@dataclass
class DataConfig:
    name: str = option("digits", flag="--data", metavar="NAME[:PATH]")
    """Dataset: ``digits``, ``synthetic-classification``, ``synthetic-regression``, ``python-stdlib`` (this
    interpreter's standard-library sources as text); a path-backed dataset is written ``NAME:PATH`` (for
    example ``mnist:/data/mnist`` or ``text:/data/books``), which sets ``path``."""
    path: str | None = None
    """Directory of a file-backed dataset."""
    test_fraction: float = 0.2
    """Fraction held out for evaluation (deterministic split by ``train.seed``)."""
    num_samples: int = 4096
    """Number of samples of a synthetic dataset."""
    num_features: int = 32
    """Input features of a synthetic dataset."""
    num_classes: int = 10
    """Classes of ``synthetic-classification``."""
    augment: bool = False
    """Random train-time augmentation where the dataset defines one."""
    seq_len: int = option(256)
    """Text datasets: tokens per training sequence (batches are packed, fixed-length sequences)."""
    tokenizer: str = "byte"
    """Text datasets: ``byte`` (UTF-8 bytes, vocabulary 256), ``bpe:N`` (a BPE of N tokens trained with
    Hugging Face tokenizers on the training split, cached in the run directory) or ``hf:DIR`` (a Hugging Face
    model's ``tokenizer.json``; the default with ``--model hf:DIR`` when the directory has one)."""
    max_bytes: int | None = None
    """Text datasets: read at most this many bytes of each split (``None``: all)."""
    cache_dir: str | None = None
    """Text datasets: where a trained tokenizer is cached (default: the run directory)."""
    text_field: str = "text"
    """``jsonl`` records: the field that holds the text (records with ``prompt``/``completion`` need none)."""

    def __post_init__(self) -> None:
        if ":" in self.name and self.path is None:
            self.name, self.path = self.name.split(":", 1)
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"data.test_fraction must be in (0, 1), got {self.test_fraction!r}.")
        check_positive("data", "num_samples", self.num_samples)
        check_positive("data", "seq_len", self.seq_len)
        check_positive("data", "max_bytes", self.max_bytes, allow_none=True)
        if (
            self.tokenizer != "byte"
            and not self.tokenizer.startswith("hf:")
            and not (
                self.tokenizer.startswith("bpe:")
                and self.tokenizer[4:].isdigit()
                and int(self.tokenizer[4:]) > 256
            )
        ):
            raise ConfigError(
                f"data.tokenizer={self.tokenizer!r}: use byte, or bpe:N with N > 256 (for example bpe:4096)."
            )
        check_positive("data", "num_features", self.num_features)
        if self.num_classes < 2:
            raise ConfigError(f"data.num_classes must be at least 2, got {self.num_classes!r}.")


@dataclass
class StrategyConfig:
    name: str = option("ddp", flag="--strategy")
    """Parallel strategy from the registry (``paratrain strategies`` lists them)."""
    dp_replicate: int | None = option(None)
    """Data-parallel replicas: ranks that hold the same (shard of the) model and all-reduce gradients.
    Default: what the strategy preset says (``ddp``: every data-parallel rank; ``hsdp``: world / shard size)."""
    dp_shard: int | None = option(None)
    """Data-parallel ranks the model, gradients and optimizer state are sharded over (ZeRO/FSDP).
    Default: what the strategy preset says (``zero*``: every data-parallel rank)."""
    tp: int | None = option(None)
    """Tensor-parallel degree (innermost mesh axis: consecutive ranks, one node). Default: what the strategy
    preset says (``tp``: every rank; ``fsdp+tp``, ``fsdp+tp+pp``: 2; the others: 1)."""
    pp: int | None = option(None)
    """Pipeline-parallel degree (outermost mesh axis). Default: what the strategy preset says (``pp``: every
    rank; ``fsdp+pp``, ``fsdp+tp+pp``: 2; the others: 1)."""
    ep: int | None = option(None)
    """Expert-parallel degree (``ep``, ``fsdp+ep``): each MoE layer's experts split over this many ranks,
    borrowed from the data-parallel ones. Default: the preset's (``ep``: every rank; ``fsdp+ep``: 2)."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB (``ddp``, ``dp``, ``zero1``/``zero2``)."""
    gradient_as_bucket_view: bool = False
    """``ddp``: let gradients alias the all-reduce buckets (saves one gradient copy of memory and the copies
    in and out of the buckets). Always on with ``--comm-algorithm shm``."""
    static_graph: bool = False
    """``ddp``: declare that the autograd graph is the same every step."""
    find_unused_parameters: bool = False
    """``ddp``: look for parameters that got no gradient. Off by default: it costs a graph walk per step."""
    comm_algorithm: str = option("native", choices=COMM_ALGORITHMS)
    """Collectives of the gradient sync: ``native`` (the backend's own) or one of paratrain's algorithms
    (``dp``: any; ``ddp``: ``native`` or ``shm`` (a DDP comm hook); ``zero1``/``zero2``: ``native`` or ``shm``;
    the others: ``native`` only)."""
    shard_size: int | None = option(None)
    """``hsdp``: ranks per shard group (sharded within a group, replicated across groups); must divide the
    world size. Default: half the world size. Same as ``--dp-shard`` for ``hsdp``."""
    offload: bool = option(False)
    """``zero3``/``hsdp``: keep parameters, gradients and optimizer state on the CPU (FSDP2
    ``CPUOffloadPolicy``); the optimizer steps on the CPU. On a CPU-only machine this changes nothing."""
    mixed_precision: str = choice("fp32", ("fp32", "bf16"))
    """``zero3``/``hsdp``: ``fp32``, or ``bf16`` (bf16 parameters for compute and bf16 gradient reduction,
    fp32 sharded master weights and optimizer state; FSDP2 ``MixedPrecisionPolicy``)."""
    shard_accumulated_grads: bool = option(False)
    """FSDP2 strategies without a pipeline (``zero3``, ``hsdp``, ``fsdp+tp``, ``fsdp+ep``, ``fsdp+tp+ep``) with
    ``--grad-accum`` > 1: reduce-scatter the gradients on every accumulation micro-step and accumulate the
    shards (DeepSpeed ZeRO-3's and torchtitan's way: one gradient shard held, one reduce-scatter per micro-step)
    instead of accumulating the full unsharded gradients and reducing once (the default: fewer collectives, a
    whole model's gradients held on each rank)."""
    shard_units: str = "blocks"
    """``zero3``/``hsdp``: modules wrapped as their own shard unit before the root: ``blocks`` (each of
    ``model.blocks``), ``root`` (only the whole model), or comma-separated submodule names (``blocks.0,head``)."""
    pp_schedule: str = option("1f1b", choices=("gpipe", "1f1b", "interleaved-1f1b"))
    """Pipeline schedule (``pp``, ``fsdp+pp``, ``fsdp+tp+pp``): ``gpipe`` (all forwards, then all backwards),
    ``1f1b`` (one forward, one backward in the steady state), ``interleaved-1f1b`` (2 stages per rank)."""
    microbatches: int | None = option(None)
    """Pipeline micro-batches per optimizer step (per accumulation step). Default: the pipeline degree."""
    sequence_parallel: bool = option(True)
    """Tensor parallel: shard the norms' activations along the sequence (all-gather before attention and
    the MLP, reduce-scatter after) instead of replicating them (all-reduce)."""
    loss_parallel: bool = option(False)
    """Tensor parallel: compute the cross-entropy on the vocabulary-sharded logits without gathering them."""

    def __post_init__(self) -> None:
        check_positive("strategy", "microbatches", self.microbatches, allow_none=True)
        check_choices(self, "strategy")
        check_positive("strategy", "bucket_cap_mb", self.bucket_cap_mb)
        check_positive("strategy", "shard_size", self.shard_size, allow_none=True)
        check_positive("strategy", "dp_replicate", self.dp_replicate, allow_none=True)
        check_positive("strategy", "dp_shard", self.dp_shard, allow_none=True)
        check_positive("strategy", "tp", self.tp, allow_none=True)
        check_positive("strategy", "pp", self.pp, allow_none=True)
        check_positive("strategy", "ep", self.ep, allow_none=True)
        if not self.shard_units.strip():
            raise ConfigError(
                "strategy.shard_units is empty: use blocks, root, or module names like blocks.0,head"
            )


@dataclass
class OptimizerConfig:
    name: str = option("adamw", flag="--optimizer", choices=("adamw", "sgd"))
    """``adamw`` (default) or ``sgd``."""
    lr: float = option(3e-3)
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (``adamw``) or L2 penalty (``sgd``)."""
    momentum: float = 0.9
    """Momentum of ``sgd``."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas, each in [0, 1)."""
    grad_clip: float | None = None
    """Clip gradients to this global L2 norm (computed across all ranks and shards). ``None``: no clipping."""
    implementation: str = choice("auto", ("auto", "for-loop", "foreach", "fused"))
    """How torch runs the update (torchtitan's names): ``fused`` (one kernel over every parameter, CPU and
    CUDA), ``foreach`` (batched per-op kernels), ``for-loop`` (one tensor at a time, torch's CPU default).
    ``auto`` (default): ``fused`` where torch's fused kernel takes the run's parameters, else torch's own
    default. The results differ from the other implementations by float rounding only (about 1e-7 relative
    per step)."""
    schedule: str = choice("constant", ("constant", "cosine"))
    """Learning-rate schedule: ``constant`` or ``cosine`` (with ``warmup_steps`` of linear warm-up)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""

    def __post_init__(self) -> None:
        check_choices(self, "optimizer")
        check_positive("optimizer", "lr", self.lr)
        check_positive("optimizer", "grad_clip", self.grad_clip, allow_none=True)
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay!r}.")
        if self.momentum < 0:
            raise ConfigError(f"optimizer.momentum must be >= 0, got {self.momentum!r}.")
        if self.warmup_steps < 0:
            raise ConfigError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps!r}.")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        for i, b in enumerate(self.betas):
            check_range("optimizer", f"betas[{i}]", b, 0.0, 1.0, hi_open=True)
