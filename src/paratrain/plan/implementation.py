"""What paratrain's own Llama (``models/llama.py``) keeps for backward, op by op: the activations the peak uses.

Korthikanti et al.'s formulas (:mod:`paratrain.plan.activations`) describe Megatron's fused kernels. paratrain's
Llama is plain PyTorch, and autograd keeps what each op's backward needs. Notation as in
:mod:`~paratrain.plan.activations`; f = ffn_hidden, a = n_heads, V = vocabulary, *E* = bytes of an activation
(4 in fp32), *F* = 4 (tensors the code computes in float32 whatever the precision). Per layer, without TP:

- each ``RMSNorm`` (two per layer) keeps its input (``x32.pow(2)`` and ``x32 * rsqrt``), its fp32 reciprocal
  RMS (sb·F) and its normalised output before the weight (``normed * weight`` needs ``normed``): 2 × (2sbh·F +
  sb·F). Megatron's fused norm keeps the input only.
- ``wq``/``wk``/``wv`` share one saved input (the first norm's output) and ``w1``/``w3`` another: 2sbh·E.
- RoPE keeps nothing (the rotation's gradient needs only the cos/sin tables). ``repeat_interleave`` widens K
  and V to all a heads before SDPA, which keeps q, the *repeated* k and v, and its output (which is also
  ``wo``'s input, a view): 4sbh·E. Megatron keeps K and V at n_kv_heads: 2sbh(1 + kv/h)·E.
- SDPA on CPU (``_scaled_dot_product_flash_attention_for_cpu``) and on CUDA (Flash / memory-efficient) keeps
  the logsumexp, a·sb·F, and no a·s² probabilities. ``attention="eager"`` (the math path) keeps the softmax
  output a·s²b·E instead.
- SwiGLU keeps w1's and w3's outputs, silu's output and the product (w2's input): 4sbf·E, as Korthikanti.

Total **sbh·(4F + 6E) + 4sbf·E + sb·(2 + a)·F**: 10sbh + 4sbf elements in fp32, against the Korthikanti
Llama's 6 + 2kv/h + 4f/h (:func:`paratrain.plan.activations.llama_layer` in elements). The difference,
2 + 2(1 − kv/h) sbh, is the two unfused normalised outputs and the repeated K/V.

**Tensor parallelism** is torch's (``parallel/tensor.py``, ``models/llama_parallel.tp_plan``): heads and the
MLP width are split, so the attention and SwiGLU terms divide by t. With sequence parallelism the norms run on
sequence shards (their terms divide by t), but ``PrepareModuleInput`` all-gathers the norm's output to the full
sequence before the column-parallel linears, and autograd keeps that *gathered* tensor as their input:
2sbh·E per layer undivided. Megatron keeps it sharded and re-gathers it in backward, which is what
Korthikanti's sbh·34/t counts. Without SP the norms are replicated too.

**First and last stage.** The embedding keeps the token ids (sb int64). The last stage keeps the final norm's
input, normed output and rstd (÷ t with SP), the output layer's input (gathered, full), the targets (sb int64)
and cross-entropy's log-softmax, sbV·F. paratrain's output layer gathers the logits to all V on every TP rank
unless ``strategy.loss_parallel`` is set, so this is ÷ t only with loss parallelism.

**Hugging Face architectures** differ in a few places the shape names: per-head q/k norms (Qwen3, Gemma 3:
each keeps its input and output, 2sb(q + kv)·F), and, planned from a meta build
(:func:`paratrain.plan.hf_config.meta_spec`), ``norms`` per layer (Gemma 2 has four), an ungated MLP (two f-wide tensors,
2sbf·E), soft-capped attention scores (eager attention keeps the tanh too, a·s²b·E) and soft-capped logits
(one more logits-sized tensor kept, sbV·E: the tanh's output; the capping's backward frees as it goes, measured
on a Gemma 2 under ddp, zero2 and zero3: ``benchmarks/results/plan_vs_measured_hf_archs.json``).

**Backward starts** with two more logits-sized tensors live at once: ``nll_loss_backward``'s gradient of the
log-probabilities and ``_log_softmax_backward_data``'s gradient of the logits, 2sbV·F: :func:`loss_grad`.
Under loss parallelism torch's DTensor handler (``torch.distributed.tensor.parallel.loss``,
``_nll_loss_and_log_softmax_backward``) fuses both into ``(grad_input + torch.exp(x)) * grad_output`` on the
vocabulary shard: ``grad_input`` (a ``zeros_like`` of the log-probabilities), ``exp(x)`` and their sum are
live at once, 3sbV·F/t.

Checked exactly against a ``saved_tensors_hooks`` trace of the real module (``tests/unit/test_plan.py``):
what is left is the rotary tables (buffers, max_seq_len·head_dim·4 bytes) that RoPE keeps a view of, and
the loss's 4-byte total weight.
Verified in fp32 (paratrain's CPU runs). Under bf16/fp16 autocast the residual stream and the norms stay in
fp32 (F), and the linear inputs are the autocast copies at E; autocast casts a shared input once per linear
(three copies for wq/wk/wv), which is not counted: that case has not been measured.
"""

from __future__ import annotations

from paratrain.plan import activations as act
from paratrain.plan.model import TransformerShape

F32 = 4
"""Bytes of the tensors the model computes in float32 at any precision (norm internals, logsumexp, the loss)."""
INT64 = 8


def layer(shape: TransformerShape, s: int, b: float, t: int = 1, sp: bool = False, attention: str = "sdpa",
          act_bytes: int = 4) -> float:  # fmt: skip
    """Bytes one paratrain Llama layer keeps for backward on one rank (see the module docstring)."""
    sb, h, f, a, e = s * b, shape.dim, shape.ffn_hidden, shape.n_heads, act_bytes
    norms = shape.norms * (2 * sb * h + sb) * F32  # per norm: input + normed output (sbh each), rstd (sb)
    linear_inputs = 2 * sb * h * e  # wq/wk/wv's and w1/w3's shared inputs (SP: gathered, full sequence)
    attention_kept = 4 * sb * h * e  # q, repeated k and v, SDPA output (= wo's input)
    attention_kept += a * sb * F32 if attention == "sdpa" else a * s * sb * e  # logsumexp, or probabilities
    if shape.qk_norms:  # per head, on the rank's heads: q and k in, normed out, and the rstd per head
        q, kv = shape.n_heads * shape.head_dim, shape.kv_dim
        attention_kept += (2 * sb * (q + kv) + sb * (a + shape.n_kv_heads)) * F32
    if attention != "sdpa" and shape.attention_softcap:
        attention_kept += a * s * sb * e  # the soft-capped scores' tanh
    mlp = (4 if shape.gated_mlp else 2) * sb * f * e  # w1 out, w3 out, silu out, product (ungated: in, out)
    return norms / (t if sp else 1) + linear_inputs + (attention_kept + mlp) / t


def first_extra(shape: TransformerShape, s: int, b: float) -> float:
    """The embedding's token ids (int64), replicated on every TP rank."""
    return s * b * INT64


def last_extra(shape: TransformerShape, s: int, b: float, t: int = 1, sp: bool = False,
               loss_parallel: bool = False, act_bytes: int = 4, compiled_loss: bool = False) -> float:  # fmt: skip
    """Final norm (input, normed, rstd), the output layer's input, the targets and the log-softmax (a compiled
    cross-entropy keeps the logits in the compute dtype instead: the fused kernel never writes the fp32
    log-probabilities)."""
    sb, h = s * b, shape.dim
    norm = (2 * sb * h + sb) * F32 / (t if sp else 1)
    head_input = sb * h * act_bytes  # all-gathered to the full sequence with SP, replicated without
    log_probs = sb * shape.vocab_size * (act_bytes if compiled_loss else F32) / (t if loss_parallel else 1)
    capped = sb * shape.vocab_size * act_bytes / (t if loss_parallel else 1) if shape.logit_softcap else 0.0
    return norm + head_input + log_probs + capped + sb * INT64


def loss_grad(shape: TransformerShape, s: int, b: float, t: int = 1, loss_parallel: bool = False,
              compiled_bytes: int = 0) -> float:  # fmt: skip
    """Transient bytes when backward starts: the gradients of the log-probabilities and of the logits (two
    logits-sized fp32 tensors), three under loss parallelism (see the module docstring). A compiled
    cross-entropy (``compiled_bytes``: the logits' dtype size) writes one gradient of the logits in their dtype
    from one fused kernel."""
    if compiled_bytes:
        return s * b * shape.vocab_size * compiled_bytes / (t if loss_parallel else 1)
    if loss_parallel:
        return 3 * s * b * shape.vocab_size * F32 / t
    return 2 * s * b * shape.vocab_size * F32


def stage(shape: TransformerShape, *, layers: int, first: bool, last: bool, s: int, b: float, t: int = 1,
          sp: bool = False, loss_parallel: bool = False, attention: str = "sdpa", act_bytes: int = 4,
          recompute: bool = False, micro: float = 1, checkpointing: str | None = None,
          compiled_loss: bool = False) -> float:  # fmt: skip
    """Activation bytes of one pipeline stage with ``micro`` micro-batches in flight (as
    :func:`paratrain.plan.activations.stage`, with paratrain's own per-layer figure). Under full recomputation a
    layer keeps its input, the residual stream: sbh·E (÷ t with SP), plus one layer's working set; under
    selective, what :data:`paratrain.parallel.parallelize.SAVE_OPS` keeps (:func:`layer_selective`)."""
    mode, every = act.checkpoint_policy(checkpointing if checkpointing is not None else recompute)
    full = layer(shape, s, b, t, sp, attention, act_bytes)
    sel = layer_selective(shape, s, b, t, sp, act_bytes) if mode == "selective" else 0.0
    kept, working = act.kept_layers(
        mode, every, layers, full, layer_input(shape, s, b, t, sp, act_bytes), sel
    )
    per_micro = kept
    per_micro += first_extra(shape, s, b) if first else 0.0
    per_micro += last_extra(shape, s, b, t, sp, loss_parallel, act_bytes, compiled_loss) if last else 0.0
    return micro * per_micro + working


def layer_input(
    shape: TransformerShape, s: int, b: float, t: int = 1, sp: bool = False, act_bytes: int = 4
) -> float:
    """What a fully checkpointed layer keeps: its input, the residual stream (÷ t with SP)."""
    return s * b * shape.dim * act_bytes / (t if sp else 1)


def layer_selective(shape: TransformerShape, s: int, b: float, t: int = 1, sp: bool = False,
                    act_bytes: int = 4) -> float:  # fmt: skip
    """What one paratrain Llama layer keeps under selective checkpointing: the layer's input and the outputs
    of SDPA (with its fp32 logsumexp) and of wq, wv, w1 and w2 (every second matmul), and with TP the kept
    all-reduces of wo and w2: the op policy torchtitan uses, so the figure is the reference one
    (:func:`paratrain.plan.activations.llama_layer_selective`) at this element size."""
    return act.llama_layer_selective(shape, s, b, t, sp, act_bytes)
