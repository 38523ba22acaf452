"""``dp``: paratrain's own data parallel, written from scratch, held to torch DDP's results and speed.

The design is DDP's (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020, https://arxiv.org/abs/2006.15704; https://pytorch.org/docs/stable/notes/ddp.html),
with the all-reduce taken from :mod:`paratrain.comm` so that ``--comm-algorithm`` picks it.

Communication schedule of one optimizer step, on every rank:

1. ``wrap()`` (once): parameters and buffers are broadcast from rank 0, so every replica starts equal.
   Gradients are grouped into buckets of at most ``bucket_cap_mb`` in *reverse registration order* (the
   order backward produces them); the first bucket is capped at 1 MiB, as in DDP, so that the first
   all-reduce starts early. Each parameter gets a post-accumulate-grad hook.
2. forward (last micro-step only): buffers (BatchNorm running stats) are broadcast from rank 0, as DDP's
   ``broadcast_buffers=True`` does. This is synchronous and small.
3. backward: when the hook of a bucket's last parameter fires, the bucket is *ready*. Ready buckets are
   launched strictly in bucket order (bucket i never starts before i-1 has), so every rank issues the
   same collectives in the same order even if their graphs differ: the gradients are copied (divided by
   the world size) into the bucket's flat buffer and its all-reduce starts asynchronously, overlapping
   the rest of backward. ``native``: ``dist.all_reduce(async_op=True)``, progressed by the backend's own
   threads. ``ring``/``tree``/``naive``/``rhd``: paratrain's algorithms are blocking functions made of
   ``isend``/``irecv``, so they run on one background thread, bucket after bucket, on a process group of
   their own (a p2p schedule must never interleave with collectives the main thread issues, such as
   SyncBatchNorm's). ``shm`` runs on that thread too, and is **zero-copy** on CPU: the buckets are
   allocated inside the shared-memory segment (:class:`~paratrain.comm.communicator.BucketAllReduce`), the peers read a bucket
   where it lies (``all_reduce_inplace_slot``), and after the
   reduction each ``param.grad`` *is* its view of the bucket, so nothing is copied back. That needs an
   arena of the buckets' bytes per rank in ``/dev/shm`` (N ranks: N times the gradients); when that
   would take more than half of the free space of ``/dev/shm`` (or the tensors are on a GPU), the buckets
   stay ordinary tensors and are copied through the segment's slots (``comm.all_reduce(..., "shm")``).
   On several nodes ``shm`` is the hierarchical all-reduce (shm inside each node, the backend's
   all-reduce between them: ``HierarchicalAllReduce``), copying.
4. end of backward (an autograd-engine callback, so ``loss.backward()`` returns with synchronised
   gradients, as with DDP): buckets not launched yet (they hold a parameter that got no gradient in this
   backward) are launched with zeros in its place; then we **wait** for every bucket, and copy the
   averaged values back into ``param.grad``. Each bucket also carries one "used" flag per parameter,
   summed by the same all-reduce: a parameter that got no gradient on *any* rank keeps ``grad=None`` (the
   optimizer skips it, as it would in one process); one used on some ranks gets their average.
5. gradient accumulation: inside :meth:`BucketedDataParallel.no_sync` the hooks return at once, so micro-steps
   only accumulate locally and communicate nothing; the last micro-step all-reduces the accumulated sum.

World size 1 installs nothing: no hooks, no copies, no communication.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain import comm
from paratrain.comm.communicator import BucketAllReduce
from paratrain.parallel.registry import register_strategy
from paratrain.parallel.strategy import Strategy
from paratrain.runtime import get_logger

FIRST_BUCKET_BYTES = 1 << 20
"""Cap of the first bucket (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``): the last layers' gradients, ready first."""


def plan_buckets(
    sizes_bytes: list[int], keys: list[Any], cap_bytes: int, first_cap_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """Group parameters (given in registration order) into buckets, in reverse registration order.

    A bucket holds parameters of one ``key`` (dtype and device) and is closed when adding the next
    parameter would pass the cap; a parameter larger than the cap gets a bucket of its own. The first
    bucket's cap is ``min(first_cap_bytes, cap_bytes)``. Returns lists of indices into ``sizes_bytes``.
    """
    buckets: list[list[int]] = []
    open_: dict[Any, tuple[list[int], int]] = {}
    for i in reversed(range(len(sizes_bytes))):
        key = keys[i]
        members, used = open_.get(key, ([], 0))
        cap = min(first_cap_bytes, cap_bytes) if not buckets else cap_bytes
        if members and used + sizes_bytes[i] > cap:
            buckets.append(members)
            members, used = [], 0
        members.append(i)
        open_[key] = (members, used + sizes_bytes[i])
    buckets.extend(m for m, _ in open_.values() if m)
    return buckets


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor
    """``numel`` gradient values followed by one used-flag per parameter."""
    pending: int = 0
    handle: Any = None
    done: set[int] = field(default_factory=set)


def _comm_all_reduce() -> Callable[..., Any]:
    """``paratrain.comm.all_reduce``, called without its per-call consistency check (one extra collective;
    every bucket's shape is fixed at wrap time and identical on all ranks)."""

    def run(buf: torch.Tensor, group: Any, algorithm: str) -> None:
        out = comm.all_reduce(buf, op="sum", algorithm=algorithm, group=group, check=False)
        if out is not buf:
            buf.copy_(out)

    return run


class GradReducer:
    """Bucketed, overlapped gradient all-reduce for one replicated module (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None,
        bucket_cap_mb: float,
        algorithm: str = "native",
        zero_copy: bool = True,
    ) -> None:
        self.module = module
        self.group = group
        self.algorithm = algorithm
        self.world_size = dist.get_world_size(group)
        self.enabled = True
        self.launched = 0
        """Buckets launched so far (tests read it: accumulation micro-steps must not change it)."""
        self.wait_s = 0.0
        """Seconds backward spent waiting for communication after its last gradient (exposed communication)."""
        self._lock = threading.Lock()
        self._queued = False
        self._next = 0
        params = [p for p in module.parameters() if p.requires_grad]
        plan = plan_buckets(
            [p.numel() * p.element_size() for p in params],
            [(p.dtype, p.device) for p in params],
            int(bucket_cap_mb * 2**20),
        )
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket index, slot in bucket)
        for b, idx in enumerate(plan):
            members = [params[i] for i in idx]
            offsets, n = [], 0
            for slot, p in enumerate(members):
                offsets.append(n)
                n += p.numel()
                self._where[id(p)] = (b, slot)
            buf = torch.zeros(n + len(members), dtype=members[0].dtype, device=members[0].device)
            self.buckets.append(_Bucket(members, offsets, n, buf))
        if algorithm == "native":
            self._executor: ThreadPoolExecutor | None = None
            self._p2p: Callable[..., Any] | None = None
        else:
            self._p2p = _comm_all_reduce()
            # A group of its own: the background thread's isend/irecv never interleave with main-thread
            # collectives (a second group gets its own Gloo/NCCL communicator).
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
            self.group = dist.new_group(ranks)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paratrain-dp")
        # the transport (collective): shared memory on one host (zero-copy: the buckets live in its arena),
        # shm inside each host and the backend between them, or the algorithm through paratrain.comm
        self.transport = BucketAllReduce(self.group, algorithm, self.buckets, zero_copy)
        self.zero_copy = self.transport.arena is not None
        if self.transport.custom:
            if algorithm == "shm":
                get_logger().info("dp --comm-algorithm shm: %s", self.transport.description)
            transport = self.transport
            # a sum: the gradients were divided by the world size on their way into the bucket
            self._p2p = lambda buf, _group, _alg: transport(buf)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._reset()

    # ---- backward-time hooks ----------------------------------------------------------------------------
    def _reset(self) -> None:
        self._next = 0
        self._queued = False
        for b in self.buckets:
            b.pending = len(b.params)
            b.handle = None
            b.done.clear()

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return  # accumulation micro-step: no communication at all
        with self._lock:
            if not self._queued:
                # Runs once the whole backward graph has executed: wait for buckets, write grads back.
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
                self._queued = True
            b, slot = self._where[id(p)]
            bucket = self.buckets[b]
            if slot in bucket.done:
                return  # reentrant checkpointing can run a leaf's hook more than once per backward
            bucket.done.add(slot)
            bucket.pending -= 1
            while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
                self._launch(self._next)
                self._next += 1

    def _launch(self, b: int) -> None:
        """Copy the bucket's gradients, divided by the world size as DDP does (the division rides on the
        copy: ``torch.mul(..., out=)`` costs what ``copy_`` does), and start its all-reduce (a sum)."""
        bucket = self.buckets[b]
        buf = bucket.buffer
        scale = 1.0 / self.world_size
        buf[bucket.numel :].fill_(1.0)  # used-flags (summed; 0 only where no rank had a gradient)
        for slot, (p, off) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
            view = buf[off : off + p.numel()]
            if p.grad is None:
                view.zero_()
                buf[bucket.numel + slot] = 0.0
            elif p.grad.data_ptr() == view.data_ptr():  # zero-copy: autograd accumulated into the bucket
                view.mul_(scale)
            else:
                torch.mul(p.grad.reshape(-1), scale, out=view)
        if self._executor is None:
            bucket.handle = dist.all_reduce(buf, group=self.group, async_op=True)
        else:
            p2p, group, algorithm = self._p2p, self.group, self.algorithm
            assert p2p is not None
            bucket.handle = self._executor.submit(p2p, buf, group, algorithm)
        self.launched += 1

    def _finalize(self) -> None:
        # Buckets with a parameter that got no gradient never became ready: launch them now, in order.
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        t0 = time.perf_counter()
        for bucket in self.buckets:  # the only place the step waits for communication
            h = bucket.handle
            h.result() if isinstance(h, Future) else h.wait()
        self.wait_s += time.perf_counter() - t0
        for bucket in self.buckets:
            buf = bucket.buffer
            used = buf[bucket.numel :].tolist() if bucket.pending else None
            for slot, (p, off) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
                if used is not None and used[slot] == 0.0:
                    p.grad = None  # no rank produced a gradient: leave it unset, as one process would
                    continue
                avg = buf[off : off + p.numel()].view_as(p)
                if self.zero_copy:
                    p.grad = avg  # zero-copy: the gradient is its view of the bucket, nothing copied back
                elif p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)
        self._reset()

    # ---- helpers ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        prev, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = prev

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.transport.close()


def broadcast_module(module: nn.Module, group: dist.ProcessGroup | None, params: bool = True) -> None:
    """Copy rank 0's parameters (when ``params``) and buffers to every rank: one broadcast per dtype."""
    tensors = [t.data for t in module.parameters()] if params else []
    tensors += [b for b in module.buffers()]
    by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for ts in by_key.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.broadcast(flat, src=src, group=group)
        off = 0
        for t in ts:
            t.copy_(flat[off : off + t.numel()].view_as(t))
            off += t.numel()


@register_strategy("dp")
class BucketedDataParallel(Strategy):
    """paratrain's own bucketed data parallel over any algorithm of :mod:`paratrain.comm`."""

    replicated_gradients = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reducer: GradReducer | None = None

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        model = model.to(self.ctx.device)
        if not self.ctx.distributed or self.ctx.world_size == 1:
            return model, optimizer
        broadcast_module(model, self.dp_group)
        self.reducer = GradReducer(
            model, self.dp_group, self.config.bucket_cap_mb, self.config.comm_algorithm
        )
        if any(True for _ in model.buffers()):
            model.register_forward_pre_hook(self._sync_buffers)
        return model, optimizer

    def _sync_buffers(self, module: nn.Module, args: Any) -> None:
        # DDP's broadcast_buffers=True: rank 0's running statistics win, before each synchronised forward.
        reducer = self.reducer
        if module.training and torch.is_grad_enabled() and reducer is not None and reducer.enabled:
            broadcast_module(module, self.dp_group, params=False)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self.reducer.no_sync() if self.reducer is not None else contextlib.nullcontext()
