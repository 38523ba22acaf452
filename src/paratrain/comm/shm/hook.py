"""A DDP communication hook that all-reduces torch DDP's gradient buckets through shared memory.

    from paratrain.comm.shm.hook import ShmHookState, shm_allreduce_hook
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(ShmHookState.create(), shm_allreduce_hook)

It replaces the default hook's Gloo all-reduce (``torch.distributed.algorithms.ddp_comm_hooks.
default_hooks.allreduce_hook``) with :meth:`paratrain.comm.shm.ShmCommunicator.all_reduce` with
``op="mean"``: each rank divides the chunk it reduced, so the bucket is not read and written once more
for the division (the default hook divides the whole bucket first). With a power-of-two group the result
equals plain DDP's bit for bit (dividing by 2^k is exact); otherwise within rounding.

**Ordering and threads.** DDP's reducer calls the hook once per bucket as autograd makes it ready, in
the same bucket order on every rank, which is what a collective needs. With ``background=True`` (the
default) the hook only queues the bucket on one worker thread owned by the state and returns a future;
the worker runs the all-reduces in FIFO order and completes each future, so backward keeps computing
the next buckets meanwhile (as with Gloo, whose all-reduce also runs on its own thread). DDP waits on
the futures at the end of backward. With ``background=False`` the all-reduce runs inside the hook.

The state owns its communicator (a segment of its own), so nothing else issues collectives on it
concurrently; create the state on every rank of the group, in the same order (creation is collective).
A group that spans several nodes takes ``ShmHookState(HierarchicalAllReduce(*node_groups(group)))``:
shm inside each node, the native backend between them (what ``paratrain train --strategy ddp
--comm-algorithm shm`` does on several nodes).
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's annotations
# with ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects, not strings.
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.shm.api import get_communicator
from paratrain.comm.shm.communicator import DEFAULT_CAPACITY_BYTES, ShmCommunicator
from paratrain.comm.shm.hier import HierarchicalAllReduce

__all__ = ["ShmHookState", "shm_allreduce_hook"]


@dataclass
class ShmHookState:
    """The hook's state: the shared-memory communicator of the DDP group and its worker thread."""

    comm: ShmCommunicator | HierarchicalAllReduce
    """Communicator over the DDP process group: one host's segment, or shm inside each node and the
    native backend between nodes (:class:`~paratrain.comm.shm.hier.HierarchicalAllReduce`)."""
    background: bool = True
    """Run the all-reduces on a worker thread (overlapping backward) instead of inside the hook."""
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def create(
        cls,
        group: Any = None,
        *,
        background: bool = True,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        timeout_s: float | None = None,
    ) -> "ShmHookState":
        """A state with a communicator of its own over ``group`` (collective: every rank calls it)."""
        return cls(ShmCommunicator(group, capacity_bytes, timeout_s), background)

    def submit(self, fn: Any) -> torch.futures.Future[torch.Tensor]:
        """Run ``fn()`` (returning the bucket tensor) on the worker thread, FIFO; a future of its result."""
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)  # type: ignore[arg-type]  # torch annotates it as T

        if not self.background:
            run()
            return fut
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paratrain-shm-hook")
        self._executor.submit(run)
        return fut

    def close(self) -> None:
        """Stop the worker thread (after the queued all-reduces) and unmap the segment."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.comm.close()


_STATES: dict[int, ShmHookState] = {}


def _resolve(state: Any) -> ShmHookState:
    """``ShmHookState`` as is; a ``ShmCommunicator`` wrapped; ``None`` or a process group: a state over
    the cached communicator of that group (created by the first bucket, which every rank reaches)."""
    if isinstance(state, ShmHookState):
        return state
    if isinstance(state, ShmCommunicator):
        key = id(state)
        if key not in _STATES or _STATES[key].comm is not state:
            _STATES[key] = ShmHookState(state)
        return _STATES[key]
    comm = get_communicator(state)
    return _resolve(comm)


def shm_allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` over the group through shared memory (sum, each chunk divided
    by the group size once), in place. ``state``: a :class:`ShmHookState` (recommended), a ``ShmCommunicator``,
    a process group or ``None`` (the default group)."""
    st = _resolve(state)
    tensor = bucket.buffer()
    comm = st.comm

    def reduce() -> torch.Tensor:
        # "mean" divides each reduced chunk once, inside the reduction: no extra pass over the bucket
        return comm.all_reduce(tensor, "mean")

    return st.submit(reduce)
