"""The peak bytes of one training step: what is live at the two moments that can be the highest.

The old estimate (model states + all activations + every buffer at once) cannot happen: backward frees the
activations while it creates the gradients, and the optimizer step runs after both. What paratrain runs
(``train/trainer.py``: ``zero_grad(set_to_none=True)``, forward, backward, ``step()``) has these candidates, and
the peak is the largest of them:

1. **Backward starts.** Parameters and optimizer state (no gradients: they were set to None), every saved
   activation, the loss's gradient (:func:`paratrain.plan.implementation.loss_grad`), and the buffers that
   exist then: DDP's gradient buckets (allocated once, a second copy of the gradients, Ψ × grad bytes);
   under bf16/fp16 autocast
   without FSDP, the 16-bit copy of every weight that forward used (autocast's cast cache, 2Ψ).
   With ``--grad-accum K > 1`` (or a pipeline stage's later micro-batches) a *later* backward starts with
   the full local gradients accumulated so far as well (no synchronisation before the last micro-step).
1b. **A checkpointed layer recomputes** (full, selective or every N-th layer): the last layer's backward reruns
   its forward, so its full activations exist again, on top of what the other layers keep and the gradient
   w.r.t. its output; the loss's logits-sized tensors (the last stage's extras, the loss gradient) are freed by
   then. Measured (``tests/dist/test_selective_ac.py``): with a large vocabulary the loss's moment is higher,
   with a small one this.
1c. **A later micro-batch's checkpointed layer recomputes**: moment 1b with the accumulated gradients
   (and a pipeline FSDP stage's unsharded parameters) of moment 1's later case, which stay through every
   micro-batch's backward.
2. **FSDP: a unit's post-backward** (``_fsdp_param_group.post_backward``), for each unit u, last to first.
   FSDP2 first reshards u's parameters, then ``foreach_reduce`` copies u's unsharded gradients into a
   reduce-scatter input (P_u) and allocates the output (P_u/N). Gloo's ``reduce_scatter`` works on one
   more full-size copy of its input (P_u; measured: a 64 KiB reduce-scatter peaks at 2.5× its input under
   MemTracker; NCCL reduces in place). Live with them: the backward prefetch of unit u−1's parameters
   (P_{u−1}, all-gathered before u's gradients are reduced), the root's parameters and gradients (unsharded
   until the end of backward), the gradient w.r.t. u's input, and the activations of the units not yet
   back-propagated. On NCCL the larger moment is while u computes: its parameters and gradients unsharded,
   2P_u. FSDP holds *one* unit plus one prefetched, never "the largest unit × 2". (paratrain reshards the root
   after forward too, so when backward starts no unit is unsharded; the root is gathered again for its
   backward, right after the loss's, and stays until the end.)
3. **ZeRO-1/2: ``step()`` waits for the reduce-scatters** (``parallel/zero.py``) launched during backward: full
   gradients (ZeRO-1; ZeRO-2 frees each gradient in its own hook, once it is in the send buffer), the send
   buffers of at most ``MAX_IN_FLIGHT`` = 2 buckets (ZeRO-2: one, the next bucket waits for the previous
   reduction), and the reduced shard Ψ/N. The activations are gone. On Gloo the bucket is all-reduced in
   place (Gloo's reduce-scatter would all-reduce a copy of it), so no second full-size buffer exists.
3b. **ZeRO-2: a gradient is packed during backward**: one send buffer, the gradient being packed (unit u's
   largest tensor, in full), and the shards of the buckets reduced before it (Ψ/N less this bucket's); with the
   units known, the activations of the units ahead of u and u's own and the gradients arriving at and leaving
   u, the highest over the units. Measured (``tests/dist/test_zero2_peak.py``): this moment is zero2's peak on
   an MLP of 25 MiB buckets, 1.03× 4Ψ + 12Ψ/N + one bucket; on the 26K MLP whose gradients fit one bucket
   (``benchmarks/bench_plan.py``), the activations and flowing gradients are a fifth of the peak.
4. **The optimizer update.** States with the gradients the step reads, DDP's buckets, ZeRO-1's reduced shard,
   and the optimizer's temporaries. paratrain's default (``optimizer.implementation=auto``) is torch's fused
   kernel, which keeps none. torch's single-tensor loop (``for-loop``, torch's own CPU default):
   ``exp_avg_sq.sqrt()`` and its quotient are two temporaries of one parameter's size (2 × the largest local
   tensor). ``foreach`` (torch's own CUDA default): ``_foreach_sqrt`` of every state at once (Ψ × 4). SGD
   updates in place.
5. **ZeRO-1/2: the all-gather of the updated rows**: a bucket's full-size buffer (in place: this rank's rows
   are its own slice of it).

Not modelled: the rotary tables and other module buffers (16 KiB for llama-debug), Python/allocator overhead,
a data loader's larger storage behind a batch slice, and on a GPU the CUDA context, NCCL buffers and
fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.plan.memory import Dtypes, States

MAX_IN_FLIGHT = 2
"""``parallel.zero.MAX_IN_FLIGHT``: reduce-scatters (and their send buffers) ZeRO-1/2 keep in flight at once."""


@dataclass(frozen=True)
class Peak:
    """The highest of the step's candidate moments: its name and the bytes live then, by term."""

    phase: str
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.terms.values())


@dataclass(frozen=True)
class StepShape:
    """Everything the peak needs about one rank's step (built by :func:`paratrain.plan.api.evaluate`)."""

    states: States
    """At-rest model states on this rank (after ``step()``)."""
    on_device: bool
    """False with ``--offload``: the states live in host memory."""
    activations: float
    """Bytes saved for backward (all in-flight micro-batches)."""
    psi: float
    """Parameters on this rank before data-parallel sharding (after tp and pp)."""
    sharding: str
    n: int
    """The dp_shard degree."""
    dp: int
    """Data-parallel ranks (gradients are reduced over them)."""
    d: Dtypes
    loss_grad: float = 0.0
    """Transient bytes when backward starts (the loss's gradient)."""
    units: tuple[float, ...] = ()
    """FSDP: parameters of each unit (block) on this rank, in forward order, before sharding."""
    unit_activations: tuple[float, ...] = ()
    """Activations each unit keeps (same order), and, for the FSDP moments, what is kept before the first one."""
    before_units: float = 0.0
    unit_input_grad: float = 0.0
    """Bytes of the gradient w.r.t. a unit's input (the residual stream, or a block's input)."""
    root: float = 0.0
    """FSDP: parameters of the root unit (embedding, final norm, head) on this rank, before sharding."""
    kept_gathered: float = 0.0
    """FSDP: bytes of a unit kept unsharded from the end of forward to its backward (an HF model's final norm
    + head unit, ``reshard_after_forward=False``): live when backward starts."""
    largest_tensor: float = 0.0
    """Elements of the largest parameter tensor this rank's optimizer updates."""
    optimizer: str = "adamw"
    optimizer_kernel: str = "for-loop"
    """How the update runs (:func:`optimizer_kernel`): ``fused``, ``foreach`` or ``for-loop``."""
    cpu: bool = True
    """Gloo and torch's CPU optimizer paths (``cpu-local``), else NCCL and CUDA's."""
    bucket_bytes: float = 25 * 2**20
    gradient_as_bucket_view: bool = False
    batch: float = 0.0
    """The batch on the device (inputs, targets). Saved activations already hold it; the moments after them
    (ZeRO's reduce-scatter, the optimizer step) count it on its own."""
    cast_copies: float = 0.0
    """bf16/fp16 autocast without FSDP: the 16-bit copy of every weight forward used, kept for backward."""
    accumulated_grads: float = 0.0
    """Local gradients a later backward starts with: under ``--grad-accum K > 1`` every strategy keeps full
    unsharded gradients between micro-steps (no synchronisation before the last), and a pipeline stage
    accumulates its gradients over the micro-batches of the schedule."""
    unit_accumulation: str = ""
    """FSDP without a pipeline under ``--grad-accum K > 1``: ``unsharded`` (the units reduce the gradients
    accumulated over the micro-steps one at a time in the last micro-step's backward) or ``sharded``
    (``--shard-accumulated-grads``: every micro-step reduce-scatters, each unit holds its reduced shard).
    A pipeline's FSDP stage reduces after its last backward (``PipelineStage.perform_reduce_grad``): ``""``."""
    later_unsharded_params: float = 0.0
    """FSDP stages of a pipeline: torch's schedule turns ``reshard_after_backward`` off until the last
    micro-batch, so after the first backward the stage's parameters stay unsharded (Ψ × compute bytes)."""
    recompute_working: float = 0.0
    """Activation checkpointing: one layer's full activations, rebuilt when its backward recomputes it."""
    released_before_recompute: float = 0.0
    """Activations the loss's backward frees before the first layer recomputes (the last stage's extras)."""
    unit_param_bytes: float = 0.0
    """Bytes per element of a unit's all-gathered (unsharded) parameters: 1 with ``--fp8-all-gather``
    (torchao's Float8Linear weights gathered in float8), 0 for the compute dtype."""
    pipeline_buffers: float = 0.0
    """Pipeline stages: the receive buffers torch's ``PipelineStage`` allocates for every micro-batch when its
    schedule starts and keeps (activations from the previous stage, gradients from the next)."""
    later_released: float = 0.0
    """One micro-batch's share of ``released_before_recompute`` (a later micro-batch's recomputation)."""
    stage_outputs: float = 0.0
    """Pipeline stages: the stage outputs torch's ``PipelineStage`` holds when backward starts (the in-flight
    micro-batches' outputs; on the last stage the logits, which ``output_chunks`` keeps)."""
    later_stage_outputs: float = 0.0
    """The same at a later micro-batch's backward: the last stage then holds every micro-batch's logits."""
    kept_stage_outputs: float = 0.0
    """The last stage's ``output_chunks`` after the last backward, through the optimizer step."""
    later_activations: float = 0.0
    """Activations saved when such a later backward starts (a pipeline that ran every micro-batch's forward
    first holds one micro-batch fewer then; 1F1B's steady state and accumulation hold as many)."""


def optimizer_kernel(optimizer: str, implementation: str, cpu: bool) -> str:
    """What runs the update of a ``paratrain train`` run (``paratrain.train.optim.set_implementation``):
    ``auto`` is torch's fused kernel for AdamW and SGD; ``default`` is torch's own choice, which an
    expert-parallel run's ``auto`` falls back to (its parameters mix DTensors and plain tensors)."""
    if implementation in ("auto", "fused") and optimizer in ("adam", "adamw", "sgd"):
        return "fused"
    if implementation in ("foreach", "for-loop"):
        return implementation
    return "for-loop" if cpu else "foreach"


def optimizer_temporaries(s: StepShape) -> float:
    if s.optimizer not in ("adam", "adamw") or s.optimizer_kernel == "fused":
        return 0.0  # the fused kernel updates each element in registers
    if s.optimizer_kernel == "for-loop":
        return 2 * s.largest_tensor * 4  # sqrt(exp_avg_sq) and its quotient by the bias correction, fp32
    held = s.psi / s.n if s.sharding != "none" else s.psi
    return held * 4  # _foreach_sqrt over every exp_avg_sq


def _fsdp_unit_moments(s: StepShape, base: dict[str, float]) -> list[Peak]:
    """The highest of the units' post-backward moments (the others never set the peak; ``--recommend``
    evaluates hundreds of layouts of 80+ units, so the per-unit totals are scalars and one dict is built)."""
    c, g, n = s.d.compute, s.d.grad, s.n
    pb = s.unit_param_bytes or c  # the all-gathered parameters (the unsharded gradients stay 16-bit)
    before = [0.0]  # before[u]: activations of the units ahead of u
    for a in s.unit_activations:
        before.append(before[-1] + a)
    fixed = sum(base.values()) + s.before_units + s.root * (c + g) + s.unit_input_grad
    # The last accumulation micro-step: unit u and the units still to reduce hold the unsharded gradients
    # accumulated so far (FSDP2's unsharded_accumulated_grad, in the reduce dtype; u's is copied into the
    # reduce-scatter's input beside it: measured on the 26K MLP under zero3 at 2 and 4 Gloo ranks, 1.00 and 0.98
    # with it, 0.87 and 0.81 without); with --shard-accumulated-grads every unit holds its reduced shard.
    acc = s.accumulated_grads / s.psi if s.unit_accumulation == "unsharded" and s.psi else 0.0
    pending = [0.0]  # pending[u + 1]: accumulated gradients of unit u and the units ahead of it
    for p in s.units:
        pending.append(pending[-1] + p * acc)
    shards = sum(s.units) * g / n if s.unit_accumulation == "sharded" else 0.0
    reduced, best_u, best_total, best_reduced = shards, -1, -1.0, shards  # reduced: shards of units after u
    best_pending = 0.0
    for u in range(len(s.units) - 1, -1, -1):
        p_u = s.units[u]
        own = max(p_u * g * (1 + 1 / n) + (p_u * g if s.cpu and n > 1 else 0.0), p_u * (pb + g))
        total = (
            fixed
            + reduced
            + pending[u + 1]
            + before[min(u, len(s.unit_activations))]
            + own
            + (s.units[u - 1] * pb if u else 0.0)
        )
        if total > best_total:
            best_u, best_total, best_reduced, best_pending = u, total, reduced, pending[u + 1]
        if not shards:
            reduced += p_u * g / n
    if best_u < 0:
        return []
    u, p_u = best_u, s.units[best_u]
    reduce, compute = p_u * g * (1 + 1 / n) + (p_u * g if s.cpu and n > 1 else 0.0), p_u * (pb + g)
    terms = dict(base)
    terms["grads"] = best_reduced
    if best_pending:
        terms["accumulated grads (this unit and those ahead)"] = best_pending
    terms["activations"] = s.before_units + before[min(u, len(s.unit_activations))]
    terms["fsdp root (params + grads)"] = s.root * (c + g)
    terms[f"unit {u} {'reduce-scatter' if reduce >= compute else 'unsharded'}"] = max(reduce, compute)
    terms["prefetched unit"] = s.units[u - 1] * pb if u > 0 else 0.0
    terms["input gradient"] = s.unit_input_grad
    return [Peak(f"FSDP post-backward of unit {u}", terms)]


def _zero2_packing(s: StepShape, base: dict[str, float], send: float) -> Peak:
    """ZeRO-2's moment 3b: a gradient is packed into the bucket's send buffer while backward runs. With the
    units known (a transformer's layers, a traced model's blocks), the highest of it over the units, last to
    first: unit u's largest gradient being packed, the activations of the units ahead of u and u's own (its
    weights' hooks fire before the autograd engine has let go of everything the unit saved), and the gradient
    arriving at u and the one it passes on. Measured (bench_plan, the 26K MLP whose gradients fit one bucket,
    2 Gloo ranks): at the peak MemTracker holds 52.7 KB of activations and 33 KB of temporaries beside the send
    buffer and the 64 KB gradient being packed. The shard reduced by then is what the buckets completed before
    unit u hold: the gradients of the root (the output layer's come first in backward) and of the units after u,
    less the bucket in flight (the MoE rows of bench_plan: 1.06-1.09 when every other bucket's shard was counted
    at every unit). Without units: the largest gradient, no activations, every other bucket reduced."""
    g, n = s.d.grad, s.n
    largest = s.largest_tensor * n * g
    reduced = max(0.0, s.psi * g / n - send / n)
    fixed = {**base, "send buffers": send, "reduced shard": reduced}
    if not (s.units and s.unit_activations and len(s.units) == len(s.unit_activations)):
        return Peak("zero2 packs a gradient during backward", {**fixed, "gradient being packed": largest})

    def shards(u: int) -> float:
        """The buckets reduced before unit u's hooks: the root's and the later units' gradients."""
        produced = (s.root + sum(s.units[u + 1 :])) * g
        return max(0.0, produced - send) / n

    before, best, best_u = 0.0, -1.0, 0
    for u, a in enumerate(s.unit_activations):
        total = min(largest, s.units[u] * g) + s.before_units + before + a + shards(u)
        if total > best:
            best, best_u = total, u
        before += a
    u = best_u
    return Peak(f"zero2 packs a gradient during backward (unit {u})", {
        **fixed, "reduced shard": shards(u), "gradient being packed": min(largest, s.units[u] * g),
        "activations": s.before_units + sum(s.unit_activations[: u + 1]),
        "output and input gradients": 2 * s.unit_input_grad})  # fmt: skip


def peak(s: StepShape) -> Peak:
    """The highest candidate moment of the step (see the module docstring)."""
    return max(moments(s), key=lambda p: p.total)


def moments(s: StepShape) -> list[Peak]:
    """Every candidate moment of the step, in the order they happen."""
    st, g, n = s.states, s.d.grad, s.n
    dev = 1.0 if s.on_device else 0.0
    base = {"params": st.params * dev, "optimizer": st.optimizer * dev}
    if s.pipeline_buffers:
        base["pipeline receive buffers"] = s.pipeline_buffers
    buckets = s.psi * g if s.sharding == "none" and s.dp > 1 and not s.gradient_as_bucket_view else 0.0
    start = {**base, "activations": s.activations, "loss gradient": s.loss_grad}
    if buckets:
        start["ddp buckets"] = buckets
    if s.cast_copies:
        start["autocast weight copies"] = s.cast_copies
    if s.stage_outputs:
        start["pipeline stage outputs"] = s.stage_outputs
    if s.kept_gathered:
        start["head unit (gathered)"] = s.kept_gathered
    out = [Peak("backward starts", start)]
    if s.recompute_working:
        redo = {**base, "activations": s.activations - s.released_before_recompute,
                "recomputed layer": s.recompute_working, "input gradient": s.unit_input_grad}  # fmt: skip
        if buckets:
            redo["ddp buckets"] = buckets
        if s.cast_copies:
            redo["autocast weight copies"] = s.cast_copies
        if s.stage_outputs:
            redo["pipeline stage outputs"] = s.stage_outputs
        out.append(Peak("a checkpointed layer recomputes", redo))
    if s.accumulated_grads:
        later = {**start, "activations": s.later_activations, "accumulated grads": s.accumulated_grads}
        if s.later_stage_outputs:
            later["pipeline stage outputs"] = s.later_stage_outputs
        if s.later_unsharded_params:
            later["unsharded params (pipeline FSDP stage)"] = s.later_unsharded_params
        out.append(Peak("a later micro-batch's backward starts", later))
        if s.recompute_working:  # the accumulated gradients stay while that micro-batch's layers recompute
            redo_later = {k: v for k, v in later.items() if k != "loss gradient"}
            redo_later.update({"activations": max(0.0, s.later_activations - s.later_released),
                               "recomputed layer": s.recompute_working, "input gradient": s.unit_input_grad})  # fmt: skip
            out.append(Peak("a later micro-batch's checkpointed layer recomputes", redo_later))
    if s.sharding == "full":  # FSDP2 gathers into unsharded buffers on one rank too
        out += _fsdp_unit_moments(s, base)
    sharded_opt = s.sharding in ("optimizer", "grads") and n > 1
    if sharded_opt:
        # zero2 keeps one full-size send buffer at a time (the next bucket waits for the previous
        # reduction); zero1 up to MAX_IN_FLIGHT
        send = min(s.psi * g, (1 if s.sharding == "grads" else MAX_IN_FLIGHT) * s.bucket_bytes)
        wait = {**base, "grads": st.grads if s.sharding == "optimizer" else 0.0, "send buffers": send,
                "reduced shard": s.psi * g / n, "batch": s.batch}  # fmt: skip
        out.append(Peak("step() waits for the reduce-scatters", wait))
        if s.sharding == "grads":
            # a bucket's first gradient is packed into its new send buffer: the previous buckets' shards are
            # reduced, this one's not yet
            out.append(_zero2_packing(s, base, send))
    update = {
        **base,
        "grads": st.grads * dev,
        "optimizer temporaries": optimizer_temporaries(s),
        "batch": s.batch,
    }
    if buckets:
        update["ddp buckets"] = buckets
    if s.kept_stage_outputs:
        update["pipeline stage outputs"] = s.kept_stage_outputs
    if sharded_opt and s.sharding == "optimizer":
        update["reduced shard"] = s.psi * g / n  # ZeRO-1: the full gradients stay, the reduced rows are extra
    out.append(Peak("optimizer update", update))
    if sharded_opt:
        gathered = min(s.psi * s.d.param, s.bucket_bytes)
        out.append(Peak("all-gather of the updated rows", {**base, "grads": st.grads * dev, "batch": s.batch,
                                                               "all-gather buffer": gathered}))  # fmt: skip
    return out
