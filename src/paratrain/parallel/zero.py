"""``zero1`` and ``zero2``: ZeRO stages 1 and 2, a sharded optimizer over replicated parameters.

ZeRO (Rajbhandari et al., 2020, https://arxiv.org/abs/1910.02054) partitions the *model states* over the
N data-parallel ranks. With fp32 Adam (4 + 4 + 8 = 16 bytes per parameter, Ψ parameters) a rank holds:

=========  ===========================  =========================================================
stage      bytes per rank               what is sharded
=========  ===========================  =========================================================
``ddp``    16Ψ                          nothing
``zero1``  4Ψ + 4Ψ + 8Ψ/N = 8Ψ + 8Ψ/N   optimizer state (Adam moments)
``zero2``  4Ψ + 4Ψ/N + 8Ψ/N             optimizer state and gradients
``zero3``  16Ψ/N                        everything (FSDP2, see :mod:`paratrain.parallel.fsdp`)
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
   while Gloo/NCCL reduces. Rank r receives the global mean gradient of exactly the rows it owns. On Gloo
   the bucket is all-reduced in place and rank r copies its rows out when the reduction is retired: Gloo's
   ``reduce_scatter_tensor`` is itself an all-reduce of a clone of its input, so this moves the same bytes
   without a second full-size buffer.

   - ``zero1``: the full local gradients stay in ``p.grad`` (ZeRO-1 keeps 4Ψ of gradients); the reduced
     rows are a transient buffer, dropped after ``step()``.
   - ``zero2``: only the reduced 4Ψ/N shard survives until the next ``zero_grad()``.

   - ``zero2``: each gradient is copied into its bucket's send buffer by its own hook, the moment it is
     ready, and freed there (``p.grad = None``); every hook first frees the send buffers of reductions
     that have completed (``is_completed()``), and a bucket's first gradient waits for the previous
     bucket's reduction before its send buffer is allocated. So one full-size send buffer exists at a
     time (the next bucket reuses the finished one's storage when it is as large: the collective's work
     object, which Gloo's worker thread lets go of some moments after ``wait()`` returns, can keep the old
     buffer alive past the next allocation): zero2's gradient memory peaks at one bucket, the 4Ψ/N shard and one fresh gradient, and the
     step's at 4Ψ + 12Ψ/N + one bucket + activations, within 10% (the reduction of a bucket overlaps the
     backward of the first gradient of the next, and its own filling with nothing: memory over overlap, as
     ZeRO-2 promises; ``tests/dist/test_zero2_peak.py``).
   - ``zero1``: a bucket is packed when its last gradient is ready; its send buffer lives while its
     reduction runs, ``MAX_IN_FLIGHT`` at most (the oldest is waited for).

   With ``--comm-algorithm shm`` the reduce-scatters run through one shared-memory segment of the
   group's ranks (:func:`~paratrain.comm.communicator.sharded_communicator`, ``reduce_scatter``: torch's
   ``reduce_scatter_tensor`` semantics, which the rank-major layout has) on one worker thread, FIFO, so
   backward still overlaps them; the all-gathers of phase 3 go through it on the main thread, one bucket
   at a time.
2. ``step()`` waits for every reduce-scatter, (optionally clips with a global norm: one all-reduce of a
   scalar), and runs the user's optimizer on the owned rows.
3. parameters: ``all_gather`` of each bucket's updated rows, in place in the bucket's full-size buffer,
   async, at most ``MAX_IN_FLIGHT`` at once for zero1 and one for zero2 (the oldest is waited for and
   copied into the full parameters before the next is launched, so the full-size gather buffers of all
   buckets never exist together). Every rank again holds identical full parameters.

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
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.communicator import sharded_communicator
from paratrain.errors import ConfigError
from paratrain.parallel.optim import clone_optimizer
from paratrain.parallel.registry import register_strategy
from paratrain.parallel.strategy import Strategy
from paratrain.parallel.zero_layout import ShardLayout, _Bucket, _Slot

MAX_IN_FLIGHT = 2
"""Reduce-scatters (and all-gathers) whose full-size buffers may exist at once; older ones are waited for."""


class _ThreadWork:
    """A collective running on the optimizer's worker thread, with the two methods of a c10d ``Work``
    used here."""

    def __init__(self, future: Future[Any]) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()

    def is_completed(self) -> bool:
        return self.future.done()


class ShardedOptimizer(ShardLayout, torch.optim.Optimizer):
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
        comm_algorithm: str = "native",
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
        self._in_flight: deque[_Bucket] = deque()  # launched reduce-scatters, oldest first
        self._spare: torch.Tensor | None = None  # zero2: the last finished send buffer, reused by the next
        self._on_gloo: bool | None = None  # known at the first reduction (the gradients' device)
        self.shm: Any = None
        self._executor: ThreadPoolExecutor | None = None
        if comm_algorithm == "shm" and self.world > 1:  # collective: every rank of the group creates it
            self.shm = sharded_communicator(group, self.world)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paratrain-zero-shm")
        self._hooks: list[Any] = []
        if self.world > 1:
            for p in params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # ---- phase 1: gradients ------------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.require_sync:
            return  # accumulation micro-step: keep the full gradient locally
        bucket = self._bucket_of[p]  # type: ignore[index]
        if self.shard_gradients:
            # ZeRO-2, during backward: free the send buffers of the reductions that have finished, then move
            # this gradient into its bucket's send buffer and free it at once, so full-size gradients never
            # pile up waiting for the rest of their bucket.
            self._retire(keep=MAX_IN_FLIGHT)
            self._pack_grad(bucket, p)
        bucket.ready += 1
        if bucket.ready == len(bucket.slots):
            self._launch_reduce(bucket)

    @torch.no_grad()
    def _pack_grad(self, b: _Bucket, p: torch.Tensor) -> None:
        """ZeRO-2: copy ``p``'s gradient into bucket ``b``'s send buffer and free it. The buffer is allocated
        by the bucket's first gradient, once the previous bucket's reduction has finished and its buffer is
        freed: ZeRO-2's gradient memory is one bucket, the reduced 4Ψ/N shard and one fresh gradient."""
        g = p.grad
        if g is None:
            return
        if b.send is None:
            self._retire(keep=0)  # one full-size send buffer at a time: the previous bucket's reduction ends
            b.send = self._send_buffer(self.world * b.segment, g)
        s = self._slots[p]  # type: ignore[index]
        self._pack(self._rank_major(b.send, b, s), g.reshape(-1), s)
        p.grad = None

    def _send_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed send buffer of ``numel`` elements: the finished bucket's storage when it is large enough
        (no allocation beside a buffer the backend may still hold), else a new one (the spare is dropped)."""
        spare, self._spare = self._spare, None
        if (
            spare is not None
            and spare.numel() >= numel
            and spare.dtype == like.dtype
            and spare.device == like.device
        ):
            return spare[:numel].zero_()
        del spare
        return torch.zeros(numel, dtype=like.dtype, device=like.device)

    @torch.no_grad()
    def _launch_reduce(self, b: _Bucket) -> None:
        b.reduced = True
        if self.world == 1:  # the owned rows are the whole parameter: its gradient needs no reduction
            for s in b.slots:
                s.shard.grad = s.param.grad.view_as(s.shard) if s.param.grad is not None else None
            return
        first = b.slots[0].param
        send = b.send  # zero2: the hooks already packed this bucket's gradients into it
        if send is None:
            self._retire(keep=MAX_IN_FLIGHT - 1)  # free finished send buffers before allocating this one
            send = torch.zeros(self.world * b.segment, dtype=first.dtype, device=first.device)
        for s in b.slots:
            g = s.param.grad
            if g is None:
                continue  # packed (and freed) by a zero2 hook, or no gradient: it contributes zeros
            self._pack(self._rank_major(send, b, s), g.reshape(-1), s)
            if self.shard_gradients:
                s.param.grad = None  # ZeRO-2: the full gradient is freed once it is in the send buffer
        b.grad = torch.empty(b.segment, dtype=first.dtype, device=first.device)
        b.in_place = False
        if self.shm is not None and self._executor is not None:
            b.work = _ThreadWork(self._executor.submit(self.shm.reduce_scatter, b.grad, send, "sum"))
        elif self._gloo(send):
            # Gloo's reduce_scatter_tensor all-reduces a clone of its input and copies out the rank's rows: the
            # same all-reduce run in place on the send buffer moves the same bytes without the clone, one full
            # bucket less at the peak. This rank's rows are copied out of it when the reduction is retired.
            b.work = dist.all_reduce(send, group=self.group, async_op=True)
            b.in_place = True
        else:
            b.work = dist.reduce_scatter_single(b.grad, send, group=self.group, async_op=True)
        b.send = send  # must outlive the asynchronous collective; freed by _retire
        self._in_flight.append(b)

    def _gloo(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s collectives on this group run on Gloo (a CPU tensor of a Gloo group)."""
        if self._on_gloo is None:
            self._on_gloo = t.device.type == "cpu" and "gloo" in str(dist.get_backend(self.group)).lower()
        return self._on_gloo

    def _retire(self, keep: int) -> None:
        """Finish the oldest reductions until at most ``keep`` are in flight, and any that already
        completed; each finished bucket drops its send buffer at once."""
        while self._in_flight and (len(self._in_flight) > keep or self._in_flight[0].work.is_completed()):
            b = self._in_flight.popleft()
            b.work.wait()
            if b.in_place:  # the all-reduced bucket: keep this rank's rows, free the rest
                b.grad.copy_(b.send[self.rank * b.segment : (self.rank + 1) * b.segment])  # type: ignore[union-attr,index]
            if self.shard_gradients and b.send is not None:  # zero2: the next bucket packs into its storage
                base = b.send if b.send._base is None else b.send._base
                if self._spare is None or base.numel() > self._spare.numel():
                    self._spare = base
            b.work, b.send = None, None
            b.grad.div_(self.world)  # type: ignore[union-attr]  # sum -> mean, once per step

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Launch the reduce-scatters not launched yet, wait for all, and point the shards' ``.grad`` at
        the reduced (mean) rows. Idempotent within a step."""
        for b in self.buckets:
            if not b.reduced:
                self._launch_reduce(b)
        self._retire(keep=0)
        self._spare = None  # no send buffer outlives the step's reduction
        for b in self.buckets:
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
        if self.shm is not None:  # shared memory: one bucket at a time, a single full buffer alive
            for b in self.buckets:
                full, mine = self._gather_buffers(b)
                self.shm.all_gather(full, mine)
                for s in b.slots:
                    self._unpack(self._rank_major(full, b, s), s.param.data.view(-1), s)
            return
        # At most MAX_IN_FLIGHT gathers (and their full-size buffers) at once, one for zero2 (its peak is
        # one bucket): the oldest is waited for and unpacked into the parameters before the next starts.
        in_flight = 1 if self.shard_gradients else MAX_IN_FLIGHT
        pending: deque[tuple[_Bucket, torch.Tensor, Any]] = deque()
        for i, b in enumerate(self.buckets):
            pending.append(self._launch_gather(b))
            while pending and (len(pending) >= in_flight or i == len(self.buckets) - 1):
                self._finish_gather(*pending.popleft())

    def _launch_gather(self, b: _Bucket) -> tuple[_Bucket, torch.Tensor, Any]:
        full, mine = self._gather_buffers(b)
        return b, full, dist.all_gather_single(full, mine, group=self.group, async_op=True)

    def _finish_gather(self, b: _Bucket, full: torch.Tensor, work: Any) -> None:
        """Wait for bucket ``b``'s all-gather and copy it into the parameters. Nothing references its buffer
        once this returns (no loop variable of the caller's), so it is freed before the next bucket's is
        allocated."""
        work.wait()
        for s in b.slots:
            self._unpack(self._rank_major(full, b, s), s.param.data.view(-1), s)

    def _gather_buffers(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """(the full rank-major output, this rank's segment of it holding its updated rows) of bucket ``b``:
        the all-gather runs in place (its input is its own slice of the output), with no second buffer."""
        first = b.slots[0].param
        full = torch.zeros(self.world * b.segment, dtype=first.dtype, device=first.device)
        mine = full[self.rank * b.segment : (self.rank + 1) * b.segment]
        for s in b.slots:
            mine[s.offset : s.offset + s.owned_numel].copy_(s.shard.reshape(-1))
        return full, mine

    def _drop_reduced(self) -> None:
        for b in self.buckets:
            b.grad, b.ready, b.reduced = None, 0, False
            for s in b.slots:
                s.shard.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._drop_reduced()


class _ZeroStage(Strategy):
    """Shared by ``zero1`` and ``zero2``: replicated parameters, :class:`ShardedOptimizer`."""

    shard_gradients = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer: ShardedOptimizer | None = None

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        model = model.to(self.ctx.device)
        group, mesh = None, None
        if self.ctx.distributed and self.topology.dp_shard > 1:
            assert self.mesh is not None
            mesh = self.mesh["dp_shard"]  # the shard axis of the run's mesh
            group = mesh.get_group()
            with torch.no_grad():  # identical replicas to start from, as DDP guarantees
                for t in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(t.data, src=dist.get_global_rank(group, 0), group=group)
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
            comm_algorithm=self.config.comm_algorithm,
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
    """Optimizer state sharded; gradients reduce-scattered after backward."""

    shard_gradients = False


@register_strategy("zero2")
class Zero2(_ZeroStage):
    """Optimizer state and gradients sharded: each bucket reduce-scattered during backward."""

    shard_gradients = True
