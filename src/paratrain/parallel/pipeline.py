"""``pp``, ``fsdp+pp``, ``fsdp+tp+pp``: pipeline parallelism with ``torch.distributed.pipelining``.

**Stages.** Every rank builds the full model from the same seed (so the weights equal ``single``'s), then
keeps the modules of the stages it owns and deletes the rest; names stay the original ones
(:func:`paratrain.models.llama_parallel.pipeline_split`): the embedding lives on the first stage, the final
norm and the head on the last, whole blocks in between. With ``pp`` ranks and ``v`` stages per rank
(``v = 2`` for ``interleaved-1f1b``, 1 otherwise) rank ``r`` owns stages ``r, r + pp, ...`` of ``pp * v``.
The model the trainer holds is the union of this rank's stages (its parameters, its optimizer state, its
checkpoint shard); each stage is a module over the same parameters that the schedule runs.

**Schedules** (https://pytorch.org/docs/stable/distributed.pipelining.html): ``gpipe`` (Huang et al. 2019)
runs all ``m`` micro-batch forwards, then all backwards; ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021)
alternates one forward and one backward once the pipeline is full, so at most ``p`` micro-batches of
activations are alive; ``interleaved-1f1b`` (Narayanan et al. 2021, https://arxiv.org/abs/2104.04473)
gives each rank ``v`` smaller stages, which shrinks the bubble by ``v``. The idle fraction of a step (the
bubble) is ``(p - 1) / (m + p - 1)`` for gpipe and 1f1b and ``(p - 1) / (v*m + p - 1)`` interleaved.

**Communication schedule of one step**, on the ``pp`` axis: per micro-batch and stage boundary, one
``send``/``recv`` of the activations (``b/m * s * h``, ``s/tp`` with sequence parallelism) in forward and one
of their gradient in backward, issued by the schedule as the micro-batches flow (the first step also
exchanges shapes). Then:

1. the last stage's loss (the mean over the micro-batches) is broadcast over ``pp``, so every rank
   returns the global mean loss, the same number as ``single``;
2. data-parallel: ``pp`` all-reduces the gradients over ``dp_replicate`` (bucketed); ``fsdp+pp`` lets FSDP2
   all-gather each unit in forward and backward and reduce-scatter its gradients once per schedule step;
3. tensor parallel (``fsdp+tp+pp``) inside each stage, as in :mod:`paratrain.parallel.tensor`;
4. clipping: the squared gradient norm of each stage, reduced over its sharded axes, then all-reduced
   over ``pp`` (stages hold disjoint parameters).

**Gradient scale.** Each micro-batch's loss is divided by ``m * grad_accum`` and the schedule does not
rescale (``scale_grads=False``), so the accumulated gradient is the mean over the whole step, as in
``single``, also when several schedule steps accumulate (``--grad-accum``).

Evaluation runs the stages in order with blocking ``send``/``recv`` of each stage's output (no schedule,
any batch size); the last stage returns the logits and the others ``None``, and the trainer all-reduces
its sums over the ``pp x dp`` group so each sample is counted once.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.models.spec import ModelSpec, expert_layers, spec_of
from paratrain.parallel.grads import clip_grad_norm, replicated_value, to_local
from paratrain.parallel.optim import canonical_name, clone_optimizer, parameter_names, rebind_optimizer
from paratrain.parallel.registry import register_strategy
from paratrain.parallel.strategy import LossFn, to_device
from paratrain.parallel.tensor import ModelParallel
from paratrain.spec.capabilities import no_stage_split

if TYPE_CHECKING:
    from paratrain.data.batch import Batch

PARAM_ORDER_ATTR = "_paratrain_param_order"
"""Attribute of a pipeline rank's model: the full model's parameter names in registration order."""
SENDER_ATTR = "_paratrain_pp_sender"
"""Attribute of a pipeline rank's model: whether it sends its stages' full parameters to rank 0 (one rank
per stage does: the one at coordinate 0 of every other axis)."""
_HEADER = 8  # int64 header of an evaluation send: [ndim, *shape], zero-padded


def stages_per_rank(config: StrategyConfig) -> int:
    return 2 if config.pp_schedule == "interleaved-1f1b" else 1


def retain_parameters(model: nn.Module, keep: set[int]) -> None:
    """Delete from ``model`` every submodule that has parameters, none of them in ``keep`` (ids): entries of a
    ModuleDict/ModuleList are removed, other attributes set to ``None``. Modules without parameters (an
    activation, dropout, rotary tables) stay: the kept layers may call them. Names of what stays are unchanged."""
    for name, child in list(model.named_children()):
        if child is None:
            continue
        params = list(child.parameters())
        if params and not any(id(p) in keep for p in params):
            if isinstance(model, nn.ModuleDict):
                del model[name]
            else:
                setattr(model, name, None)
        else:
            retain_parameters(child, keep)


def _drop_other_stages(optimizer: Any, names: dict[int, str], model: nn.Module) -> Any:
    """An optimizer built over the full model (``paratrain.setup``), rebuilt over this rank's stages only."""
    if optimizer is None:
        return None
    present = {canonical_name(n) for n, _ in model.named_parameters()}
    groups = [
        {**g, "params": [p for p in g["params"] if names.get(id(p)) in present]}
        for g in optimizer.param_groups
    ]
    if sum(len(g["params"]) for g in groups) == sum(len(g["params"]) for g in optimizer.param_groups):
        return optimizer
    if optimizer.state:
        raise ValueError(
            "setup(): create the optimizer, call setup(), then train: this one has already stepped"
        )
    return clone_optimizer(optimizer, groups)


def _first_and_last(model: nn.Module, split: Any, num_stages: int) -> list[frozenset[str]]:
    """The parameters that the first and the last stage both use (a tied embedding and head), each as the
    set of its names, in the model's order."""
    if num_stages < 2:
        return []
    first = {id(p) for p in split(model, num_stages, 0).parameters()}
    last = {id(p) for p in split(model, num_stages, num_stages - 1).parameters()}
    names: dict[int, set[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first and id(p) in last:
            names.setdefault(id(p), set()).add(canonical_name(n))
    return [frozenset(v) for v in names.values()]


def _drop_foreign_owners(model: nn.Module, owned: set[int]) -> None:
    """Remove the modules outside this rank's stages that still hold one of its parameters (the first
    stage's rank drops the tied head, the last's the tied embedding): FSDP2 replaces a parameter only on
    the modules of the stage it wraps, so a second owner would keep a stale copy."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if child is None or any(id(m) in owned for m in child.modules()):
                continue
            if any(True for _ in child.parameters()):
                if isinstance(parent, nn.ModuleDict):
                    del parent[name]
                else:
                    setattr(parent, name, None)


def _model_spec(model: nn.Module) -> ModelSpec:
    """The model's spec, refused unless it can cut the model into stages."""
    spec = spec_of(model)
    if spec is None or spec.pipeline_split is None or spec.stage_blocks is None:
        if spec is not None and spec.check_pipeline is not None:
            spec.check_pipeline(model, 0)  # a family that cannot be split may refuse in its own words
        family = f" (model family {spec.family!r})" if spec is not None else ""
        raise ConfigError(no_stage_split(f"{type(model).__name__}{family}"))
    return spec


def _split_fn(model: nn.Module) -> Any:
    return _model_spec(model).pipeline_split


class _Pipeline(ModelParallel):
    # the schedule runs each stage module once per micro-batch, out of MemTracker's per-module order
    peak_by_module = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_stages = self.topology.pp * stages_per_rank(self.config)
        pp_rank = self.topology.coordinates(self.ctx.rank)["pp"] if self.ctx.world_size > 1 else 0
        self.pp_rank = pp_rank
        self.owned = [pp_rank + k * self.topology.pp for k in range(stages_per_rank(self.config))]
        """The stage indices this rank runs, in order."""
        self.chunks: list[nn.Module] = []
        self._schedule: Any = None
        self._eval_group: Any = None
        self._schedule_key: tuple[Any, ...] | None = None
        self.tied: list[frozenset[str]] = []
        """Parameters of both the first and the last stage (a tied input embedding and output head), each as
        the set of its names (the first stage's rank keeps it under the embedding, the last's under the head)."""

    @classmethod
    def check_model(cls, model: nn.Module, world_size: int, config: StrategyConfig) -> None:
        super().check_model(model, world_size, config)
        topo = cls.topology_for(world_size, config)
        spec = _model_spec(model)
        if spec.check_pipeline is not None:
            spec.check_pipeline(model, topo.pp * stages_per_rank(config))

    # ---- groups --------------------------------------------------------------------------------------
    def eval_group(self) -> dist.ProcessGroup | None:
        """``pp x dp``: only the last stage has sums; the other stages add zeros (each sample counted once)."""
        if not self.ctx.distributed or self.mesh is None:
            return None
        if self._eval_group is None:
            self._eval_group = self.axis_group(("pp", "dp_replicate", "dp_shard"))
        return self._eval_group

    # ---- transforms ----------------------------------------------------------------------------------
    def apply_tensor_parallel(self, model: nn.Module) -> nn.Module:
        """Keep this rank's stages (the full model was built from the seed on every rank), then apply TP."""
        split = _split_fn(model)
        order = [canonical_name(n) for n, _ in model.named_parameters()]
        # names of every parameter before pruning: an optimizer over the full model drops the others in wrap()
        self._names_before_tp.update(parameter_names(model))
        chunks = [split(model, self.num_stages, s) for s in self.owned]
        keep = {id(p) for c in chunks for p in c.parameters()}
        self.tied = _first_and_last(model, split, self.num_stages)
        retain_parameters(model, keep)
        if self.tied:  # a tied matrix stays only under the owned stages' module (the embedding or the head)
            _drop_foreign_owners(model, {id(m) for c in chunks for m in c.modules()})
        setattr(model, PARAM_ORDER_ATTR, order)
        c = self.topology.coordinates(self.ctx.rank) if self.ctx.world_size > 1 else {}
        setattr(model, SENDER_ATTR, all(c.get(a, 0) == 0 for a in ("dp_replicate", "dp_shard", "tp")))
        return super().apply_tensor_parallel(model)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        """Cut the stage modules (after activation checkpointing and compile wrapped the blocks), FSDP2 each
        stage (its blocks as units), and make a ``PipelineStage`` of each."""
        from torch.distributed.pipelining import PipelineStage

        model = to_device(model, self.ctx.device)
        split = _split_fn(model)
        self.chunks = [split(model, self.num_stages, s) for s in self.owned]
        names = self.parameter_names(model)
        present = {canonical_name(n) for n, _ in model.named_parameters()}
        for aliases in self.tied:  # a tied matrix goes by the name it has on this rank (embedding or head)
            here = next((n for n in sorted(aliases) if n in present), None)
            names = {k: here if here is not None and v in aliases else v for k, v in names.items()}
        if self.uses_fsdp:
            stage_blocks = _model_spec(model).stage_blocks
            assert stage_blocks is not None
            units = [block for c in self.chunks for block in stage_blocks(c)]
            self.fully_shard(units, self.chunks)
        optimizer = rebind_optimizer(_drop_other_stages(optimizer, names, model), names, model)
        group = self.group("pp") if self.mesh is not None else None
        self.stages = [
            _uncounted_inference(PipelineStage(c, s, self.num_stages, self.ctx.device, group=group))
            for c, s in zip(self.chunks, self.owned, strict=True)
        ]
        return model, optimizer

    # ---- the step ------------------------------------------------------------------------------------
    def _make_schedule(self, loss_fn: LossFn, microbatches: int, scale: int) -> Any:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        key = (loss_fn, microbatches, scale)
        if self._schedule is not None and self._schedule_key == key:
            return self._schedule

        def scaled_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss_fn(out, target) / scale

        name = self.config.pp_schedule
        if name == "interleaved-1f1b":
            stages: list[Any] = list(self.stages)
            schedule: Any = ScheduleInterleaved1F1B(stages, microbatches, scaled_loss, scale_grads=False)
        else:
            cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
            schedule = cls(self.stages[0], microbatches, scaled_loss, scale_grads=False)
        self._schedule, self._schedule_key = schedule, key
        return schedule

    @property
    def has_first(self) -> bool:
        return 0 in self.owned

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.owned

    def forward_backward(
        self, model: nn.Module, batch: Batch, loss_fn: LossFn, precision: Any, micro_batches: int
    ) -> torch.Tensor:
        """``micro_batches`` (``--grad-accum``) schedule steps of ``m`` pipeline micro-batches each; returns the
        mean loss of the step on every rank (broadcast from the last stage over ``pp``)."""
        if getattr(precision, "scaler", None) is not None:
            raise ConfigError("--precision fp16 (loss scaling) does not work with a pipeline; use bf16.")
        m = self.config.microbatches or self.topology.pp
        parts = batch.split(micro_batches)
        if len(parts[0]) % m:
            raise ConfigError(
                f"the per-rank micro-batch of {len(parts[0])} samples does not split into --microbatches {m} "
                "equal pipeline micro-batches: make the per-rank batch a multiple of it."
            )
        schedule = self._make_schedule(loss_fn, m, m * micro_batches)
        total = torch.zeros((), device=self.ctx.device)
        for mb in parts:
            losses: list[torch.Tensor] = []
            args = (mb.inputs,) if self.has_first else ()
            # return_outputs=False: the losses are all the step needs, so the last stage does not keep every
            # micro-batch's output (the logits) in output_chunks until the next step
            with self.loss_context(), precision.autocast():
                if self.has_last:
                    schedule.step(*args, target=mb.targets, losses=losses, return_outputs=False)
                else:
                    schedule.step(*args, return_outputs=False)
            for loss in losses:  # each already divided by m * micro_batches: the sum is the step's mean
                total += to_local(loss.detach()).float()
        self._sum_tied_grads(model)
        if self.mesh is not None and self.topology.pp > 1:
            group = self.group("pp")
            dist.broadcast(total, src=dist.get_global_rank(group, self.topology.pp - 1), group=group)
        self.sync_replicas(model)
        return total

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # forward_backward handles accumulation itself

    def _tied_params(self, model: nn.Module) -> list[nn.Parameter]:
        by_name = {canonical_name(n): p for n, p in model.named_parameters()}
        return [next(by_name[n] for n in names if n in by_name) for names in self.tied]

    def _sum_tied_grads(self, model: nn.Module) -> None:
        """A matrix of the first and the last stage (a tied embedding and head) is held by both ranks, each
        with the gradient of its own use: they swap and add them, so both hold the whole gradient and apply
        the same update (the copies stay equal, as one tied matrix would)."""
        if not self.tied or self.mesh is None or self.topology.pp < 2 or self.has_first == self.has_last:
            return
        group = self.group("pp")
        peer = dist.get_global_rank(group, self.topology.pp - 1 if self.has_first else 0)
        for p in self._tied_params(model):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local = to_local(p.grad)
            mine, other = (
                local.contiguous().clone(),
                torch.empty_like(local, memory_format=torch.contiguous_format),
            )
            if self.has_first:
                dist.send(mine, peer, group=group)
                dist.recv(other, peer, group=group)
            else:
                dist.recv(other, peer, group=group)
                dist.send(mine, peer, group=group)
            with torch.no_grad():
                local.add_(other)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global norm over the stages (``pp``), a tied matrix counted once (on the first stage's rank);
        the last stage's copy takes the same coefficient."""
        group = self.group("pp") if self.mesh is not None and self.topology.pp > 1 else None
        copies = self._tied_params(model) if self.has_last and not self.has_first else []
        skip = {id(p) for p in copies}
        params = [p for p in model.parameters() if id(p) not in skip]
        norm = clip_grad_norm(params, max_norm, self.ctx.device, extra_group=group)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        with torch.no_grad():
            for p in copies:
                if p.grad is not None:
                    local = to_local(p.grad)
                    local.mul_(coef.to(local.device, local.dtype))
        return norm

    def evaluate_forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """Run the stages in order: each receives its input from the previous stage's rank and sends its
        output on (blocking p2p over ``pp``). The last stage returns the logits, the other ranks ``None``."""
        pp = self.topology.pp
        group = self.group("pp") if pp > 1 else None
        h: torch.Tensor | None = None
        for s in range(self.num_stages):
            owner = s % pp
            if owner != self.pp_rank:
                continue
            if s == 0:
                x = inputs
            elif (s - 1) % pp == self.pp_rank:
                assert h is not None
                x = h
            else:
                x = _recv(group, (s - 1) % pp, self.ctx.device)
            h = self.chunks[self.owned.index(s)](x)
            if s < self.num_stages - 1 and (s + 1) % pp != self.pp_rank:
                _send(replicated_value(h).float(), group, (s + 1) % pp)
        return replicated_value(h) if self.has_last and h is not None else None


def _uncounted_inference(stage: Any) -> Any:
    """``stage`` with its MoE layers in eval mode while torch infers the stage's shapes at the first step.

    That inference runs a real forward and backward of the stage (every rank of the stage together, so the
    experts' all-to-alls pair up) on placeholder inputs; its routed tokens must not enter the expert-bias
    counts nor leave an auxiliary loss behind (an :class:`~paratrain.models.spec.ExpertLayer` records only in training)."""
    layers = expert_layers(stage.submod)
    infer = getattr(stage, "_forward_metadata_inference", None)
    if not layers or infer is None:
        return stage

    def quiet(*args: Any, **kwargs: Any) -> Any:
        modes = [m.training for m in layers]
        for m in layers:
            m.training = False
        try:
            return infer(*args, **kwargs)
        finally:
            for m, mode in zip(layers, modes, strict=True):
                m.training = mode

    stage._forward_metadata_inference = quiet
    return stage


def _send(t: torch.Tensor, group: Any, peer: int) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = t.dim()
    header[1 : 1 + t.dim()] = torch.tensor(t.shape)
    dst = dist.get_global_rank(group, peer)
    dist.send(header.to(t.device), dst=dst, group=group)
    dist.send(t.contiguous(), dst=dst, group=group)


def _recv(group: Any, peer: int, device: torch.device) -> torch.Tensor:
    src = dist.get_global_rank(group, peer)
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    shape = [int(v) for v in header[1 : 1 + int(header[0])]]
    out = torch.empty(shape, dtype=torch.float32, device=device)
    dist.recv(out, src=src, group=group)
    return out


@register_strategy("pp")
class PipelineParallel(_Pipeline):
    """Pipeline stages; the data-parallel ranks left over are replicas."""


@register_strategy("fsdp+pp")
class FSDPPipelineParallel(_Pipeline):
    """Pipeline stages, each sharded with FSDP2 over its data-parallel ranks."""


@register_strategy("fsdp+tp+pp")
class FSDPTensorPipelineParallel(_Pipeline):
    """Pipeline stages, tensor parallel inside each, FSDP2 over the rest."""
