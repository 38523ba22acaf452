"""Activation memory of a transformer layer, following Korthikanti et al. 2022, and of a pipeline stage.

Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro, "Reducing Activation Recomputation in Large
Transformer Models", MLSys 2023, https://arxiv.org/abs/2205.05198, section 4. Notation: s sequence length,
b micro-batch (sequences), h hidden size, a heads, t tensor-parallel degree, f MLP hidden size, kv the
width of K and V (n_kv_heads × head_dim), V vocabulary. Bytes, 16-bit activations:

**GPT layer** (the paper's model; f = 4h), saved for backward:

- attention: QKV input 2sbh, Q and K 4sbh, softmax output 2as²b, its dropout mask as²b, dropout output
  2as²b, V 2sbh, output projection input 2sbh, output dropout mask sbh → 11sbh + 5as²b;
- MLP: first linear input 2sbh, GeLU input 8sbh, GeLU output 8sbh, dropout mask sbh → 19sbh;
- two LayerNorm inputs 4sbh. Total **sbh(34 + 5as/h)**.
- TP t without sequence parallelism: the LayerNorm inputs, the QKV and MLP inputs (8sbh) and the two
  dropout masks (2sbh) are replicated: **sbh(10 + 24/t + 5as/(ht))**. With SP everything is split:
  **sbh(34/t + 5as/(ht))**.

**Llama layer** (RMSNorm, GQA, RoPE, SwiGLU, no dropout, no biases), derived the same way:

- attention: attention_norm input 2sbh and its output (the wq/wk/wv input) 2sbh; Q after RoPE 2sbh; K and
  V 2·sb·kv each (4sbh·kv/h: GQA keeps K/V at n_kv_heads; with kv = h it is GPT's 4sbh); the wo input
  2sbh; eager attention adds the softmax output 2as²b (no dropout: no mask, no dropout output).
- MLP: ffn_norm input 2sbh and output (the w1/w3 input) 2sbh; w1's output (silu's input) 2sbf, silu's
  output 2sbf and w3's output 2sbf (both saved by the product), the product (w2's input) 2sbf → 8sbf.
- Total **sbh(12 + 4·kv/h + 8f/h + 2as/h)**. Against GPT's 34 + 5as/h: −2 (no dropout masks), −3as/h (no
  attention dropout), −4(1 − kv/h) (GQA), and 8f/h (three MLP matrices, four f-wide tensors) instead of
  GPT's 16 + 2 (GeLU input/output at f = 4h, plus the MLP dropout mask); Llama's f ≈ 8h/3 gives 21.3.
  Llama 2 7B (kv = h, f = 11008): 37.5 + 2as/h.
- TP without SP replicates the two norm inputs and the wq/wk/wv and w1/w3 inputs: **sbh(8 + (4 + 4kv/h +
  8f/h + 2as/h)/t)**; with SP everything divides by t.
- Not counted (small, or implementation detail): RMSNorm's fp32 rstd (4sb), FlashAttention's logsumexp
  (4asb), int64 token ids. What paratrain's own Llama keeps on top (unfused RMSNorm's normalised output,
  K/V repeated to n_heads, torch's SP keeping the all-gathered linear inputs, the gathered logits) is
  derived in :mod:`paratrain.plan.implementation`; the planner's peak uses that figure, this one is the
  reference it reports as ``activations_korthikanti``.

**Attention kernels**: ``attention="sdpa"`` (FlashAttention / memory-efficient SDPA) recomputes the
attention scores in backward, dropping the as²-term; ``"eager"`` keeps it.

**fp32 activations** (paratrain on CPU) double the 2-byte terms; dropout masks stay 1 byte.

**Full recomputation** (activation checkpointing of every layer): a layer keeps only its input, 2sbh
(2sbh/t with SP), plus, once, the working set of the layer being recomputed (its full activations).

**Selective (op-level) recomputation**, torchtitan's policy (``parallel/parallelize.SAVE_OPS``): a layer keeps
its input and the outputs of attention and of every second matmul in forward order (wq, wv, w1, w2 of wq, wk,
wv, wo, w1, w3, w2): Q 2sbh, V 2sb·kv, the attention output 2sbh, w1's output 2sbf, w2's output 2sbh, plus the
input 2sbh → **sbh(8 + 2kv/h + 2f/h)**, with SDPA's logsumexp 4asb. Under TP the heads and f divide by t; w2's
output is the row-parallel partial sum (sbh, undivided) and the all-reduces (reduce-scatters with SP) of wo and
w2 are kept too (collectives are never rerun). Llama 3 8B (kv = h/4, f = 3.5h): 15.5sbh, against 41sbh without
checkpointing and 2sbh with full. During a layer's backward its full activations exist again, as with full.
``selective:N`` checkpoints every N-th layer fully and keeps the others whole.

**Embedding and logits**: GPT's embedding dropout mask sbh on the first stage; on the last stage the final
norm's input 2sbh, the output projection's input 2sbh (both /t with SP), the logits s·b·V·2 and the fp32
copy cross-entropy works on (its log-softmax output) s·b·V·4, both /t (vocabulary-parallel output and
loss with TP).

**Pipeline** (Narayanan et al. 2021, https://arxiv.org/abs/2104.04473): a stage holds the activations of
its in-flight micro-batches: all m with GPipe, min(m, p − i) on stage i with 1F1B.
"""

from __future__ import annotations

from paratrain.config import ac_policy
from paratrain.errors import ConfigError
from paratrain.plan.model import ActivationProfile, TransformerShape

ATTENTION = ("sdpa", "eager")
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
VIRTUAL_STAGES = 2
"""Stages per rank of ``interleaved-1f1b`` (``parallel/pipeline.py``: rank r runs stages r and r + pp)."""


def gpt_layer(s: int, b: float, h: int, a: int, t: int = 1, sp: bool = False, attention: str = "eager",
              act_bytes: int = 2, f: int | None = None) -> float:  # fmt: skip
    """Korthikanti's bytes per GPT layer (see the module docstring)."""
    f = 4 * h if f is None else f
    w = act_bytes / 2
    replicated = 8 * w + 2  # LN inputs 4 + QKV input 2 + MLP input 2 (16-bit), two 1-byte dropout masks
    sharded = (4 + 2 + 2 + 4 * f / h) * w  # Q,K 4 + V 2 + proj input 2 + GeLU in/out 4f/h
    scores = (4 * w + 1) * a * s / h if attention == "eager" else 0.0  # softmax 2, mask 1, dropout out 2
    if sp:
        return s * b * h * (replicated + sharded + scores) / t
    return s * b * h * (replicated + (sharded + scores) / t)


def llama_layer(shape: TransformerShape, s: int, b: float, t: int = 1, sp: bool = False,
                attention: str = "sdpa", act_bytes: int = 2) -> float:  # fmt: skip
    """Bytes per Llama layer (see the module docstring)."""
    h, w = shape.dim, act_bytes / 2
    replicated = 8 * w  # two norm inputs, wq/wk/wv input, w1/w3 input
    mlp = 8 if shape.gated_mlp else 4  # SwiGLU's w1 out, w3 out, silu out, product; ungated: act in and out
    sharded = (4 + 4 * shape.kv_dim / h + mlp * shape.ffn_hidden / h) * w  # Q + wo input, K+V, MLP
    scores = 2 * w * shape.n_heads * s / h if attention == "eager" else 0.0
    if sp:
        return s * b * h * (replicated + sharded + scores) / t
    return s * b * h * (replicated + (sharded + scores) / t)


def layer(shape: TransformerShape, s: int, b: float, t: int = 1, sp: bool = False, attention: str = "sdpa",
          act_bytes: int = 2) -> float:  # fmt: skip
    if attention not in ATTENTION:
        raise ConfigError(f"attention {attention!r}: choose one of {', '.join(ATTENTION)}.")
    if shape.arch == "gpt":
        return gpt_layer(s, b, shape.dim, shape.n_heads, t, sp, attention, act_bytes, shape.ffn_hidden)
    return llama_layer(shape, s, b, t, sp, attention, act_bytes)


def llama_layer_selective(shape: TransformerShape, s: int, b: float, t: int = 1, sp: bool = False,
                          act_bytes: int = 2) -> float:  # fmt: skip
    """Bytes a Llama layer keeps under selective (op-level) checkpointing (see the module docstring)."""
    h, e = shape.dim, act_bytes  # e: bytes of one element
    local = (1 + shape.kv_dim / h + 1 + shape.ffn_hidden / h) * e / t  # Q, V, attention out, w1 out
    lse = 4 * shape.n_heads / h / t  # SDPA's fp32 logsumexp, a·s·b·4 bytes
    sharded = t if sp else 1
    kept = e / sharded + e  # the layer's input, w2's output (the row-parallel partial sum under TP)
    if t > 1:
        kept += 2 * e / sharded  # the all-reduces (reduce-scatters with SP) of wo's and w2's outputs
    return s * b * h * (local + lse + kept)


def checkpoint_policy(checkpointing: str | bool | None) -> tuple[str, int]:
    """``(mode, every)``: ``none``, ``full``, ``selective`` or ``every`` N-th layer (``selective:N``)."""
    return ac_policy(checkpointing)


def kept_layers(
    mode: str, every: int, layers: int, full: float, inp: float, selective: float
) -> tuple[float, float]:
    """``(bytes the stage's layers keep per micro-batch, working set of the layer being recomputed)``."""
    if mode == "none" or not layers:
        return layers * full, 0.0
    if mode == "full":
        return layers * inp, full
    if mode == "selective":
        return layers * selective, full
    checkpointed = layers // every
    return checkpointed * inp + (layers - checkpointed) * full, full if checkpointed else 0.0


def layer_input(
    shape: TransformerShape, s: int, b: float, t: int = 1, sp: bool = False, act_bytes: int = 2
) -> float:
    """What full recomputation keeps per layer: its input, 2sbh (÷ t with sequence parallelism)."""
    return s * b * shape.dim * act_bytes / (t if sp else 1)


def first_extra(shape: TransformerShape, s: int, b: float, t: int = 1, sp: bool = False) -> float:
    """Embedding: GPT's dropout mask (1 byte), none for Llama (the embedding output is layer 0's input)."""
    return s * b * shape.dim / (t if sp else 1) if shape.arch == "gpt" else 0.0


def last_extra(
    shape: TransformerShape, s: int, b: float, t: int = 1, sp: bool = False, act_bytes: int = 2
) -> float:
    """Final norm input + output projection input, the logits and cross-entropy's fp32 copy."""
    hidden = 2 * s * b * shape.dim * act_bytes / (t if sp else 1)
    logits = s * b * shape.vocab_size * (act_bytes + 4) / t
    return hidden + logits


def in_flight(schedule: str, m: int, p: int, stage: int) -> float:
    """Micro-batches whose activations rank ``stage`` holds at once, in units of its whole stage (all its
    layers for one micro-batch).

    Interleaved 1F1B (torch's ``ScheduleInterleaved1F1B``, v = 2 chunks of L/(p·v) layers per rank) runs
    (v − 1)·p + 2(p − 1 − i) warm-up forwards of chunks on rank i before its first backward, then holds one more:
    (v − 1)·p + 2(p − 1 − i) + 1 chunk activations, at most v·m, i.e. that ÷ v stage units. Rank 0 holds
    (3p − 1)/2 against 1F1B's p: the price of a bubble v times smaller."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}.")
    if schedule == "gpipe" or p == 1:
        return m
    if schedule == "interleaved-1f1b":
        v = VIRTUAL_STAGES
        return min(v * m, (v - 1) * p + 2 * (p - 1 - stage) + 1) / v
    return min(m, p - stage)


def bubble_fraction(schedule: str, m: int, p: int) -> float:
    """Idle slots over busy ones of a pipeline step (Narayanan et al. 2021): (p − 1)/m, and (p − 1)/(v·m)
    interleaved (a chunk is 1/v of a stage's work, and the fill and drain go chunk by chunk)."""
    if p == 1:
        return 0.0
    return (p - 1) / (m * (VIRTUAL_STAGES if schedule == "interleaved-1f1b" else 1))


def split_layers(n_layers: int, pp: int) -> list[int]:
    """Layers per stage as paratrain splits them (``models.llama_parallel.split_layers``): even, the remainder
    going to the *first* stages (10 layers on 4 stages: 3, 3, 2, 2)."""
    base, extra = divmod(n_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def stage(
    shape: TransformerShape, *, layers: int, first: bool, last: bool, s: int, b: float, t: int = 1,
    sp: bool = False, attention: str = "sdpa", act_bytes: int = 2, recompute: bool = False, micro: float = 1,
    checkpointing: str | None = None,
) -> float:  # fmt: skip
    """Activation bytes of one pipeline stage holding ``micro`` in-flight micro-batches of b sequences;
    ``checkpointing`` (``none``/``full``/``selective``/``selective:N``) wins over ``recompute`` (= full)."""
    mode, every = checkpoint_policy(checkpointing if checkpointing is not None else recompute)
    full = layer(shape, s, b, t, sp, attention, act_bytes)
    sel = llama_layer_selective(shape, s, b, t, sp, act_bytes) if mode == "selective" else 0.0
    kept, working = kept_layers(mode, every, layers, full, layer_input(shape, s, b, t, sp, act_bytes), sel)
    per_micro = kept
    per_micro += first_extra(shape, s, b, t, sp) if first else 0.0
    per_micro += last_extra(shape, s, b, t, sp, act_bytes) if last else 0.0
    return micro * per_micro + working


def module(profile: ActivationProfile, b: float, act_bytes: int = 4, recompute: bool = False) -> float:
    """Activation bytes of a traced model (fp32 trace; 16-bit activations halve it) for a batch of ``b``."""
    per_sample = profile.saved
    if recompute and profile.blocks_saved:
        per_sample += sum(profile.blocks_input) - sum(profile.blocks_saved) + max(profile.blocks_saved)
    return b * per_sample * act_bytes / 4
