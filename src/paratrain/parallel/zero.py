"""``zero1`` and ``zero2``: ZeRO stages 1 and 2, a sharded optimizer over replicated parameters.

ZeRO (Rajbhandari et al., 2020, https://arxiv.org/abs/1910.02054) partitions the *model states* over the
N data-parallel ranks. With fp32 Adam (4 + 4 + 8 = 16 bytes per parameter, Ψ parameters) a rank holds:

=========  ===========================  =========================================================
stage      bytes per rank               what is sharded
=========  ===========================  =========================================================
``ddp``    16Ψ                          nothing
``zero1``  4Ψ + 4Ψ + 8Ψ/N = 8Ψ + 8Ψ/N   optimizer state (Adam moments)
``zero2``  4Ψ + 4Ψ/N + 8Ψ/N             optimizer state and gradients
``zero3``  16Ψ/N                        everything (FSDP2, see :mod:`paratrain.parallel.hsdp`)
=========  ===========================  =========================================================

How it is done here (the scheme of DeepSpeed stages 1/2 and of nanochat's ``DistAdamW``). Every parameter
is split along tensor dim 0 into N chunks of ``ceil(d0 / N)`` rows (``torch.chunk`` / DTensor ``Shard(0)``
semantics; trailing ranks may get fewer or no rows). Rank r *owns* chunk r of every parameter: its
optimizer state exists only for those rows. The user's optimizer class runs unchanged over the owned
rows, which are views into the full parameters, so there is no separate master copy.

Communication schedule of one step (parameters are flattened into buckets of ``bucket_cap_mb``, laid out
rank-major so that one collective moves a whole bucket):

1. gradients: ``reduce_scatter`` (sum, then / N) of each bucket, launched *during backward*, async, from a
   post-accumulate-grad hook as soon as the last gradient of a bucket is ready; backward keeps computing
   while Gloo/NCCL reduces. Rank r receives the global mean gradient of exactly the rows it owns.

   - ``zero1``: the full local gradients stay in ``p.grad`` (ZeRO-1 keeps 4Ψ of gradients); the reduced
     rows are a transient buffer, dropped after ``step()``.
   - ``zero2``: once a bucket's gradients are in the send buffer they are freed (``p.grad = None``), so
     only the reduced 4Ψ/N shard survives until the next ``zero_grad()``.
2. ``step()`` waits for every reduce-scatter, (optionally clips with a global norm: one all-reduce of a
   scalar), and runs the user's optimizer on the owned rows.
3. parameters: ``all_gather`` of each bucket's updated rows, all launched async, then each is waited for
   and copied into the full parameters. Every rank again holds identical full parameters.

An all-reduce is exactly a reduce-scatter followed by an all-gather, so ZeRO-1/2 send the same 2Ψ per rank
as DDP's all-reduce ("gradients are all-reduced": the all-reduce is split around the sharded update).
Inside ``no_sync()`` (gradient accumulation) the hooks do nothing, so gradients accumulate locally in full
and are reduced once, on the last micro-batch. Buckets a hook did not launch (a parameter without a
gradient, or gradients set by hand) are reduced in ``step()``. With one rank nothing is communicated: the
owned rows are the whole parameter and its gradient is used as is.

Optimizer state is exposed to Distributed Checkpoint (DCP) as DTensors with ``Shard(0)`` over a 1-D mesh
and the parameter's full shape, so DCP saves each rank's rows once and can reshard the checkpoint into
any other strategy or world size (``zero3``, ``ddp``, ...).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import ConfigError, StrategyConfig
from paratrain.parallel import Strategy, clone_optimizer, register_strategy


@dataclass(eq=False)
class _Slot:
    """One parameter inside a bucket: its rows, its place in the rank-major flat layout, its shard."""

    param: nn.Parameter
    chunk_rows: int  # ceil(d0 / N): rows of every rank's chunk in the (padded) flat layout
    row_numel: int  # elements per row (prod of dims 1..)
    lo: int  # first row this rank owns
    hi: int  # one past the last row this rank owns (lo == hi: owns nothing)
    offset: int  # start of this parameter's chunk inside one rank's segment
    shard: nn.Parameter  # view of param rows [lo:hi]: what the inner optimizer updates

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @property
    def owned_numel(self) -> int:
        return (self.hi - self.lo) * self.row_numel


@dataclass(eq=False)
class _Bucket:
    slots: list[_Slot]
    segment: int  # elements of one rank's segment (sum of padded chunk sizes)
    ready: int = 0  # gradients ready in this backward (zero2 hooks)
    work: Any = None  # in-flight reduce-scatter
    send: torch.Tensor | None = None  # reduce-scatter input, kept alive until the work finishes
    grad: torch.Tensor | None = None  # reduced gradient of this rank's segment (after wait: mean)
    reduced: bool = False


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps a user's optimizer: same class and param-group options, state only for this rank's rows.

    ``param_groups`` are the user's groups over the full parameters (an LR scheduler drives them; the
    options are copied into the inner optimizer before every step). ``optim`` is the inner optimizer over
    the owned rows; its state is what this rank holds.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: dist.ProcessGroup | None,
        mesh: Any,
        shard_gradients: bool,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        if optimizer.state:
            raise ValueError(
                "ShardedOptimizer: wrap the optimizer before its first step (its state is not empty)"
            )
        groups = [dict(g) for g in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        self.group = group
        self.mesh = mesh
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.shard_gradients = shard_gradients
        self.require_sync = True
        self._slots: dict[nn.Parameter, _Slot] = {}
        self._bucket_of: dict[nn.Parameter, _Bucket] = {}
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            if p.dim() == 0:
                raise ConfigError(
                    "zero1/zero2 shard parameters along dim 0, and a 0-dim parameter has none. "
                    "Use --strategy zero3 for this model."
                )
        # Buckets in reverse registration order: roughly the order in which backward produces gradients,
        # so zero2's first bucket is complete (and its reduce-scatter starts) early in backward.
        self.buckets = self._make_buckets(list(reversed(params)), int(bucket_cap_mb * 2**20))
        inner_groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [self._slots[p].shard for p in g["params"]],
            }
            for g in self.param_groups
        ]
        self.optim = clone_optimizer(optimizer, inner_groups)
        self._hooks: list[Any] = []
        if self.world > 1:
            for p in params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # ---- layout ----------------------------------------------------------------------------------------
    def _make_buckets(self, params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        slots: list[_Slot] = []
        offset = 0
        for p in params:
            d0 = p.shape[0]
            chunk_rows = math.ceil(d0 / self.world)
            row_numel = p[0].numel() if d0 else 0
            lo = min(self.rank * chunk_rows, d0)
            hi = min(lo + chunk_rows, d0)
            shard = nn.Parameter(p.detach()[lo:hi], requires_grad=p.requires_grad)  # shares p's storage
            slot = _Slot(p, chunk_rows, row_numel, lo, hi, offset, shard)
            self._slots[p] = slot
            slots.append(slot)
            offset += slot.chunk_numel
            if offset * self.world * p.element_size() >= cap_bytes:
                buckets.append(_Bucket(slots, offset))
                slots, offset = [], 0
        if slots:
            buckets.append(_Bucket(slots, offset))
        for b in buckets:
            for s in b.slots:
                self._bucket_of[s.param] = b
        return buckets

    def _rank_major(self, flat: torch.Tensor, b: _Bucket, s: _Slot) -> torch.Tensor:
        """View of ``flat`` (N * segment elements) as (N, chunk) for slot ``s``: row j = rank j's chunk."""
        return flat.view(self.world, b.segment)[:, s.offset : s.offset + s.chunk_numel]

    @staticmethod
    def _full_chunks(s: _Slot) -> tuple[int, int]:
        """(ranks whose chunk is full, elements of the one partial chunk after them)."""
        total = s.param.shape[0] * s.row_numel
        full = total // s.chunk_numel if s.chunk_numel else 0
        return full, total - full * (s.chunk_numel if s.chunk_numel else 0)

    def _pack(self, dst: torch.Tensor, src: torch.Tensor, s: _Slot) -> None:
        """Copy a full tensor (flat) into its (N, chunk) rank-major view ``dst``; padding is left alone."""
        k, rem = self._full_chunks(s)
        if k:
            dst[:k].copy_(src[: k * s.chunk_numel].view(k, s.chunk_numel))
        if rem:
            dst[k, :rem].copy_(src[k * s.chunk_numel :])

    def _unpack(self, src: torch.Tensor, dst: torch.Tensor, s: _Slot) -> None:
        """Inverse of :meth:`_pack`: the (N, chunk) view ``src`` back into the full tensor (flat)."""
        k, rem = self._full_chunks(s)
        if k:
            dst[: k * s.chunk_numel].view(k, s.chunk_numel).copy_(src[:k])
        if rem:
            dst[k * s.chunk_numel :].copy_(src[k, :rem])

    # ---- phase 1: gradients ------------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.require_sync:
            return  # accumulation micro-step: keep the full gradient locally
        bucket = self._bucket_of[p]  # type: ignore[index]
        bucket.ready += 1
        if bucket.ready == len(bucket.slots):
            self._launch_reduce(bucket)

    @torch.no_grad()
    def _launch_reduce(self, b: _Bucket) -> None:
        b.reduced = True
        if self.world == 1:  # the owned rows are the whole parameter: its gradient needs no reduction
            for s in b.slots:
                s.shard.grad = s.param.grad.view_as(s.shard) if s.param.grad is not None else None
            return
        first = b.slots[0].param
        send = torch.zeros(self.world * b.segment, dtype=first.dtype, device=first.device)
        for s in b.slots:
            g = s.param.grad
            if g is None:
                continue  # a parameter without gradient contributes zeros
            self._pack(self._rank_major(send, b, s), g.reshape(-1), s)
            if self.shard_gradients:
                s.param.grad = None  # ZeRO-2: the full gradient is freed once it is in the send buffer
        b.grad = torch.empty(b.segment, dtype=first.dtype, device=first.device)
        b.work = dist.reduce_scatter_single(b.grad, send, group=self.group, async_op=True)
        b.send = send  # must outlive the asynchronous collective

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Launch the reduce-scatters not launched yet, wait for all, and point the shards' ``.grad`` at
        the reduced (mean) rows. Idempotent within a step."""
        for b in self.buckets:
            if not b.reduced:
                self._launch_reduce(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work, b.send = None, None
                b.grad.div_(self.world)  # type: ignore[union-attr]  # sum -> mean, once per step
            if b.grad is None:
                continue  # one rank: the shards already point at the gradients
            for s in b.slots:
                if s.shard.requires_grad:
                    s.shard.grad = b.grad[s.offset : s.offset + s.owned_numel].view_as(s.shard)  # type: ignore[index]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip to the global L2 norm of the *reduced* gradient (torch's formula, one scalar all-reduce)."""
        self.reduce_gradients()
        grads = [s.shard.grad for s in self._slots.values() if s.shard.grad is not None]
        dev = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float32, device=dev)
        for g in grads:
            sq += g.float().pow(2).sum()
        if self.world > 1:
            dist.all_reduce(sq, group=self.group)  # owned rows are disjoint: the sum is the global sum
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    # ---- phases 2 and 3: update the owned rows, all-gather the parameters --------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.reduce_gradients()
        for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # LR schedules act on `outer`
        self.optim.step()
        self._gather_parameters()
        if not self.shard_gradients:
            self._drop_reduced()  # ZeRO-1 keeps the full local gradients; the reduced copy is transient
        self._refresh_state_view()
        return loss

    @torch.no_grad()
    def _gather_parameters(self) -> None:
        if self.world == 1:
            return  # the shard *is* the parameter
        pending = []
        for b in self.buckets:
            first = b.slots[0].param
            mine = torch.zeros(b.segment, dtype=first.dtype, device=first.device)
            for s in b.slots:
                mine[s.offset : s.offset + s.owned_numel].copy_(s.shard.reshape(-1))
            full = torch.empty(self.world * b.segment, dtype=first.dtype, device=first.device)
            pending.append(
                (b, full, mine, dist.all_gather_single(full, mine, group=self.group, async_op=True))
            )
        for b, full, _mine, work in pending:  # all gathers are in flight; wait in launch order
            work.wait()
            for s in b.slots:
                self._unpack(self._rank_major(full, b, s), s.param.data.view(-1), s)

    def _drop_reduced(self) -> None:
        for b in self.buckets:
            b.grad, b.ready, b.reduced = None, 0, False
            for s in b.slots:
                s.shard.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._drop_reduced()

    # ---- state for Distributed Checkpoint ------------------------------------------------------------
    def _as_global(self, value: Any, s: _Slot) -> Any:
        """Per-row state of the owned rows -> DTensor ``Shard(0)`` with the parameter's full shape."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != s.shard.shape:
            return value
        if self.mesh is None:
            return value  # one rank: the owned rows are all rows
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(
            value, self.mesh, [Shard(0)], run_check=False, shape=s.param.shape, stride=s.param.stride()
        )

    def _refresh_state_view(self) -> None:
        # ``self.state`` mirrors the inner state keyed by the full parameters (DCP checks it is non-empty).
        self.state.clear()
        for p, s in self._slots.items():
            st = self.optim.state.get(s.shard)
            if st:
                self.state[p] = {k: self._as_global(v, s) for k, v in st.items()}

    def _ordered(self) -> list[nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        self._refresh_state_view()
        order = self._ordered()
        index: dict[torch.Tensor, int] = {p: i for i, p in enumerate(order)}
        state = {index[p]: dict(st) for p, st in self.state.items()}
        groups = []
        for g in self.param_groups:
            groups.append(
                {**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
            )
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}"
            )
        # Saved keys (indices, or FQNs when DCP hands the dict over) map to parameters by position in the
        # groups, as torch.optim.Optimizer.load_state_dict does.
        key_to_param: dict[Any, nn.Parameter] = {}
        for g, sg in zip(self.param_groups, saved_groups, strict=True):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError("optimizer state: a param group has a different number of parameters")
            key_to_param.update(zip(sg["params"], g["params"], strict=True))
            g.update({k: v for k, v in sg.items() if k != "params"})
        for key, st in state_dict["state"].items():
            p = key_to_param[key]
            s = self._slots[p]
            local: dict[str, Any] = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    to_local = getattr(v, "to_local", None)
                    if callable(to_local):
                        v = to_local()
                    elif v.dim() > 0 and v.shape == p.shape:
                        v = v[s.lo : s.hi]  # a full (unsharded) tensor: keep the owned rows
                    dev = s.shard.device if v.dim() > 0 else v.device
                    v = v.detach().to(dev).clone()
                local[k] = v
            self.optim.state[s.shard] = local
        for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self._refresh_state_view()


class _ZeroStage(Strategy):
    """Shared by ``zero1`` and ``zero2``: replicated parameters, :class:`ShardedOptimizer`."""

    shard_gradients = False

    def __init__(self, ctx: Any, config: StrategyConfig) -> None:
        super().__init__(ctx, config)
        self.optimizer: ShardedOptimizer | None = None

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        model = model.to(self.ctx.device)
        group, mesh = None, None
        if self.ctx.distributed and self.ctx.world_size > 1:
            from paratrain.parallel.mesh import Topology

            mesh = Topology(self.ctx.world_size, shard=self.ctx.world_size).build_mesh(
                self.ctx.device.type, ("shard",)
            )
            group = mesh.get_group()
            with torch.no_grad():  # identical replicas to start from, as DDP guarantees
                for t in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(t.data, src=0, group=group)
            if any(b.is_floating_point() for b in model.buffers()):
                model.register_forward_pre_hook(self._sync_buffers(group))
        if optimizer is None:
            return model, None
        self.optimizer = ShardedOptimizer(
            optimizer,
            group,
            mesh,
            shard_gradients=self.shard_gradients,
            bucket_cap_mb=self.config.bucket_cap_mb,
        )
        return model, self.optimizer

    @staticmethod
    def _sync_buffers(group: dist.ProcessGroup) -> Any:
        # Like DDP's forward_sync_buffers: BatchNorm running stats follow rank 0, so replicas stay equal.
        def hook(module: nn.Module, _args: Any) -> None:
            if module.training:
                with torch.no_grad():
                    for b in module.buffers():
                        dist.broadcast(b, src=dist.get_global_rank(group, 0), group=group)

        return hook

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self._no_sync()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        opt = self.optimizer
        if opt is None:
            yield
            return
        opt.require_sync = False
        try:
            yield
        finally:
            opt.require_sync = True

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        if self.optimizer is None:
            return super().clip_grad_norm(model, max_norm)
        return self.optimizer.clip_grad_norm_(max_norm)


@register_strategy("zero1")
class Zero1(_ZeroStage):
    description = "ZeRO-1: optimizer state sharded; gradients reduce-scattered + parameters all-gathered (2Ψ)"
    shard_gradients = False


@register_strategy("zero2")
class Zero2(_ZeroStage):
    description = (
        "ZeRO-2: optimizer state and gradients sharded (reduce-scatter in backward); params replicated"
    )
    shard_gradients = True
