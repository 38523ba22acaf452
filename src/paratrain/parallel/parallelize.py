"""``parallelize(model, strategy, ...)``: the model transforms of a run, in torchtitan's fixed order.

1. tensor parallel (the strategy's TP plan over the ``tp`` mesh axis), when ``tp > 1``;
2. SyncBatchNorm, chosen automatically for small per-rank batches (a layer swap; it must precede wrapping);
3. activation checkpointing of each block (Chen et al., "Training Deep Nets with Sublinear Memory Cost",
   2016, https://arxiv.org/abs/1604.06174; https://pytorch.org/docs/stable/checkpoint.html): ``full``, each
   block keeps only its input in forward and recomputes its activations in backward; ``selective``, op-level
   (torchtitan's policy, :data:`SAVE_OPS`); ``selective:N``, every N-th block fully;
4. ``torch.compile`` per block, when asked for (not with tensor parallelism: the launcher refuses it);
5. the data-parallel wrap: FSDP2 or replication (:meth:`Strategy.wrap`), which also rebinds the optimizer.

Wrappers register hooks on the modules and parameters they see at wrap time, so the order matters: each
step sees the modules the previous one produced.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from paratrain.config import RunConfig, ac_policy
from paratrain.errors import ConfigError
from paratrain.models.spec import model_blocks as spec_model_blocks
from paratrain.models.spec import spec_of
from paratrain.parallel.layers import choose_sync_batchnorm, convert_sync_batchnorm, count_batchnorm
from paratrain.parallel.strategy import Strategy, has_meta_parameters, to_device


def model_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The repeated blocks of a model, as its spec says (:func:`paratrain.models.spec.model_blocks`):
    ``None`` when it has none."""
    blocks = spec_model_blocks(model)
    return blocks or None


def _replace_blocks(model: nn.Module, fn: Any) -> int:
    spec = spec_of(model)
    if spec is not None and spec.fsdp_units is not None:  # blocks the spec finds anywhere in the model
        blocks = {id(b) for b in spec.fsdp_units(model)}
        parents = [(m, k) for m in model.modules() for k, c in m.named_children() if id(c) in blocks]
        for parent, key in parents:
            setattr(parent, key, fn(getattr(parent, key)))  # ModuleList/ModuleDict keys too
        if parents:
            return len(parents)
    for attr in ("blocks", "layers"):
        container = getattr(model, attr, None)
        if isinstance(container, nn.ModuleDict) and len(container) > 0:
            for key in list(container.keys()):
                container[key] = fn(container[key])
            return len(container)
        if isinstance(container, nn.ModuleList) and len(container) > 0:
            for i, block in enumerate(container):
                container[i] = fn(block)
            return len(container)
    raise ConfigError(
        f"--activation-checkpointing needs a model with `blocks` or `layers`; {type(model).__name__} has none."
    )


def preflight_features(cfg: RunConfig, model: nn.Module) -> list[str]:
    """Checks run in the launching process on the (meta-device) model: errors raise :class:`ConfigError`,
    non-fatal problems are returned as warnings for the CLI to print."""
    warnings: list[str] = []
    if cfg.train.sync_batchnorm and count_batchnorm(model) == 0:
        warnings.append(
            f"--sync-batchnorm has no effect: model {cfg.model.name!r} has no BatchNorm layer "
            "(use --model resnet, or --set model.batchnorm=true with --model cnn)."
        )
    if ac_policy(cfg.train.activation_checkpointing)[0] != "none" and model_blocks(model) is None:
        raise ConfigError(
            f"--activation-checkpointing recomputes the model's blocks, and model {cfg.model.name!r} "
            "has none. Drop the flag or use a model with blocks (cnn, resnet, llama, ...)."
        )
    return warnings


# ---- activation checkpointing ------------------------------------------------------------------------------
class _KeepBatchNormStats:
    """Recompute context: BatchNorm running statistics must be updated once per step, not once per forward,
    so the block's BatchNorm buffers are saved before the recompute and restored after it."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.saved = [
            (b, b.clone())
            for m in self.block.modules()
            if isinstance(m, _BatchNorm)
            for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if b is not None
        ]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, s in self.saved:
                b.copy_(s)
        self.saved = []


def _contexts(block: nn.Module) -> tuple[contextlib.AbstractContextManager[None], Any]:
    return contextlib.nullcontext(), _KeepBatchNormStats(block)


def _save_ops() -> set[Any]:
    aten, ops = torch.ops.aten, torch.ops
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")  # fmt: skip
    attention = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default, *attention,
            ops._c10d_functional.reduce_scatter_tensor.default, ops._c10d_functional.all_reduce.default}  # fmt: skip


SAVE_OPS = _save_ops()
"""Selective checkpointing's policy (torchtitan's ``_op_sac_save_list``, extended to bmm/addmm/convolution and
TP's all-reduce): these ops' outputs are kept in forward, except every second matrix multiply of a block
(``mm``/``addmm``: in a Llama block wq, wv, w1 and w2 are kept, wk, wo and w3 recomputed); everything else (norms,
RoPE, SiLU, products, casts, K/V repeats) is recomputed in backward. Attention and collectives are never rerun."""
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _passing_through(mode: type) -> type:
    """``mode`` (one of torch's two selective-checkpointing dispatch modes) with two kinds of op run as they
    come, outside its bookkeeping: the profiler's record_function spans, and every op of an FSDP2 hook that
    :func:`shield_fsdp_hooks` shields. The recomputation must meet every other op of the forward in the same
    order and number; these need not, and do not: a module sharded inside a checkpointed block (``fsdp+ep``'s
    experts) opens a different number of spans, and gathers its parameters by another path, while recomputing
    in backward than in forward (torch then stops with "... encountered during backward but not found in
    storage")."""

    class Mode(mode):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in _PROFILER_OPS or _FSDP_HOOKS.depth:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    Mode.__name__ = Mode.__qualname__ = f"PassingThrough{mode.__name__}"
    return Mode


_PROFILER_OPS = {torch.ops.profiler._record_function_enter_new.default,
                 torch.ops.profiler._record_function_exit._RecordFunction}  # fmt: skip


class _HookDepth(threading.local):
    depth = 0


_FSDP_HOOKS = _HookDepth()
"""How many FSDP2 forward hooks of a module inside a checkpointed block this thread is running
(:func:`shield_fsdp_hooks`): their ops bypass selective checkpointing's bookkeeping."""


def shield_fsdp_hooks(*roots: nn.Module) -> int:
    """Run the forward hooks of every FSDP2 module inside a checkpointed block outside selective checkpointing's
    bookkeeping; returns how many modules were shielded.

    FSDP2's pre-forward gathers a unit's parameters (or finds them gathered by a prefetch) and its post-forward
    frees them; recomputing in backward, the same hooks take another path (the gather happens there, with its
    copies). A unit nested inside a checkpointed block (``fsdp+ep``'s experts, sharded over their own mesh)
    therefore runs different ops while recomputing than in forward, and torch's selective checkpointing, which
    must meet the forward's ops again in order, stops ("aten.copy_.default encountered during backward but not
    found in storage"). The hooks only move parameters: their ops need no caching and are run as they come;
    the unit's own computation stays under the policy."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    def enter(*_: Any) -> None:
        _FSDP_HOOKS.depth += 1

    def leave(*_: Any) -> None:
        _FSDP_HOOKS.depth -= 1

    shielded = 0
    for root in roots:
        for wrapper in root.modules():
            if not isinstance(wrapper, CheckpointWrapper):
                continue
            inner: nn.Module = wrapper._checkpoint_wrapped_module
            for m in inner.modules():
                if isinstance(m, FSDPModule) and not getattr(m, "_paratrain_shielded", False):
                    m.register_forward_pre_hook(enter, prepend=True)  # before FSDP's pre-forward
                    m.register_forward_pre_hook(leave)  # after it
                    m.register_forward_hook(enter, prepend=True)  # before FSDP's post-forward
                    m.register_forward_hook(leave)
                    setattr(m, "_paratrain_shielded", True)  # noqa: B010
                    shielded += 1
    return shielded


def _selective_contexts(block: nn.Module) -> tuple[Any, Any]:
    from torch.utils.checkpoint import CheckpointPolicy

    count = {"forward": 0, "recompute": 0}  # one per block call: the recompute must take the same decisions

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in _MATMULS:
            count[mode] += 1
            if count[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    # torch's create_selective_checkpoint_contexts(policy), with profiler spans and FSDP hooks passed through
    storage: dict[Any, dict[int, Any]] = defaultdict(dict)
    forward = _CACHING(policy, storage)
    recompute = _CACHED(None, storage)
    if not _has_batchnorm(block):  # two dispatch modes, as torch.compile requires of a checkpoint's contexts
        return forward, recompute
    return forward, _Both(recompute, _KeepBatchNormStats(block))


def _has_batchnorm(block: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in block.modules())


def _modes() -> tuple[type, type]:
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    return _passing_through(_CachingTorchDispatchMode), _passing_through(_CachedTorchDispatchMode)


_CACHING, _CACHED = _modes()


class _Both:
    """Two context managers entered in order, left in reverse."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts, self.stack = contexts, contextlib.ExitStack()

    def __enter__(self) -> None:
        for c in self.contexts:
            self.stack.enter_context(c)

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


def apply_activation_checkpointing(model: nn.Module, mode: str | bool = "full") -> int:
    """Wrap blocks in non-reentrant activation checkpointing per ``mode`` (``full``, ``selective`` op-level, or
    ``selective:N``: every N-th block fully); returns how many blocks were wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    kind, every = ac_policy(mode)
    contexts = _selective_contexts if kind == "selective" else _contexts
    seen = [0]

    def wrap(block: nn.Module) -> nn.Module:
        seen[0] += 1
        if kind == "every" and seen[0] % every:
            return block
        if contexts is _contexts and not _has_batchnorm(block):  # plain recomputation: torch's own contexts
            return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                  context_fn=functools.partial(contexts, block))  # fmt: skip

    _replace_blocks(model, wrap)
    return seen[0] if kind != "every" else seen[0] // every


def apply_compile(model: nn.Module) -> int:
    """``torch.compile`` each block in place (``Module.compile`` keeps parameter names unchanged)."""
    blocks = model_blocks(model)
    targets = blocks if blocks is not None else [model]
    for block in targets:
        block.compile()
    return len(targets)


def parallelize(
    model: nn.Module,
    strategy: Strategy,
    optimizer_factory: Any,
    cfg: RunConfig,
    log: logging.Logger | None = None,
) -> tuple[nn.Module, Any]:
    """Apply the run's transforms in order (module docstring) and build the optimizer; returns both.

    ``optimizer_factory(model)`` is called after the model is on its device (and tensor-parallel sharded),
    before the data-parallel wrap, which rebinds it to sharded parameters where needed.
    """
    t = cfg.train
    deferred = has_meta_parameters(model)
    model = strategy.apply_tensor_parallel(to_device(model, strategy.ctx.device))
    micro = t.batch_size // (strategy.dp_size * t.grad_accum)
    on, why = choose_sync_batchnorm(t.sync_batchnorm, count_batchnorm(model), micro, strategy.dp_size)
    if log is not None:
        log.info("sync-batchnorm: %s", why)
    if on:
        model = convert_sync_batchnorm(model, strategy.batchnorm_group())
    if ac_policy(t.activation_checkpointing)[0] != "none":
        n = apply_activation_checkpointing(model, t.activation_checkpointing)
        if log is not None:
            log.info("activation checkpointing: %d blocks recompute their activations in backward (%s)",
                     n, t.activation_checkpointing)  # fmt: skip
    if t.compile:
        if ac_policy(t.activation_checkpointing)[0] != "none" and count_batchnorm(model):
            raise ConfigError(
                "--compile with --activation-checkpointing on a model with BatchNorm: the recomputation must "
                "restore BatchNorm's running statistics, which a compiled checkpoint cannot do. Drop --compile "
                "or --activation-checkpointing."
            )
        n = apply_compile(model)
        if log is not None:
            log.info("torch.compile: %d module(s) compiled", n)
    if (
        deferred and strategy.materializes_after_wrap()
    ):  # FSDP2 shards the meta model, then each rank fills its shard
        model, _ = strategy.wrap(model, None)
        materialize_deferred(model, strategy.ctx.device)
        wrapped = model, optimizer_factory(model)
    else:
        if deferred:  # the replicas (or this rank's tp slices, pipeline stages) are allocated and read here
            materialize_deferred(model, strategy.ctx.device)
        optimizer = optimizer_factory(model)
        wrapped = strategy.wrap(model, optimizer)
    if ac_policy(t.activation_checkpointing)[0] == "selective":
        shield_fsdp_hooks(wrapped[0], *getattr(strategy, "chunks", ()))
    return wrapped


def materialize_deferred(model: nn.Module, device: torch.device) -> None:
    """Allocate and fill a model built with its parameters on the meta device, as split and sharded now, with
    its spec's ``materialize`` (a Hugging Face model reads its slices of the safetensors files)."""
    spec = spec_of(model)
    if spec is None or spec.materialize is None:
        raise ConfigError(
            f"model {type(model).__name__} has parameters on the meta device and no way to fill them (its model "
            "spec has no `materialize`). Build it on a real device, or give its spec a materialize function."
        )
    spec.materialize(model, device)
