"""Collectives among the ranks of one host through one shared-memory segment per group (algorithm ``shm``).

    from paratrain.comm import shm
    shm.all_reduce(grad, op="mean")                 # in place, comm's conventions (group=None: world)
    part = shm.reduce_scatter(t, op="sum")          # torch.tensor_split(result, n)[rank] along dim 0
    full = shm.all_gather(shard)                    # every rank's tensor, dim 0, group-rank order
    shm.broadcast(param, src=0)                     # in place; src is a global rank, as in torch

    c = shm.ShmCommunicator(group, capacity_bytes=8 << 20, arena_bytes=64 << 20)
    c.reduce_scatter(out, inp, op="sum")            # torch's reduce_scatter_tensor semantics
    c.all_gather(out, inp)                          # torch's all_gather_into_tensor semantics
    bucket = c.allocate((numel,), torch.float32)    # lives in this rank's arena inside the segment
    ...; c.all_reduce_inplace_slot(bucket, "mean")  # zero copy: peers read the bucket where it lies

**Files.** This package's docstring: the protocol. :mod:`.communicator`: the collectives; :mod:`.api`: the
module-level functions; :mod:`.direct`: the direct path; :mod:`.hook`: DDP's comm hook;
:mod:`.segment`: the segment (creation handshake, mapping, flags, waiting, zero-copy arena);
:mod:`.system`: fences, futex, process liveness, names, stale sweep; :mod:`.ops`: reduction ops
and call signatures; :mod:`.hier`: the hierarchical all-reduce over several hosts.

Gloo moves every byte of a one-host collective through TCP loopback (copy into a socket, copy out, a
kernel wake-up per message). Here the ranks map the same memory: a rank copies its input into its own
*slot*, raises a flag, and the others read it where it lies. No byte goes through a socket and no
Gloo round trip is on the fast path; synchronisation is sequence-numbered flags in the segment.

**Segment.** The group's rank 0 creates ``/dev/shm/paratrain-shm-<pidns>-<pid>-<token>-<job>-<group>``
(``O_EXCL``, mode 0600); its name travels through the c10d store of the process group (``store=`` to
use another), together with each rank's host name and boot id: ranks on different hosts are refused with
one ``ValueError`` on every rank. Every rank maps it and reports through the store; as soon as every
rank has mapped it, the name is **unlinked**.

**Cleanup strategy.** After the unlink the segment has no name: the kernel frees it when the last
mapping goes, on every exit path, SIGKILL and OOM-kill included, without any cleanup code running. The
only window in which a name exists is the creation handshake (well under a second). A creator killed
inside that window leaves a name behind; the next creation on the host sweeps names whose creator
(same pid namespace, pid in the name) no longer exists. :meth:`ShmCommunicator.close` (also called at
exit for the cached communicators) unmaps this rank's view early.

**Layout** (n ranks, C = ``capacity_bytes``, A = ``arena_bytes``; every region 64-byte aligned)::

    header   4 KiB+   one 256-byte line per rank: flags ARRIVE, REDUCED, DONE (int64, written only by
                      that rank, monotonically increasing), STATUS, pid, start time, two call signatures,
                      the direct path's tensor address; rank 0's also the paths it chose (tune.py)
    slots    2·n·C    two buffers (b = seq mod 2) of one C-byte slot per rank: inputs
    results  2·C      two buffers of reduced pieces (all_reduce / reduce): rank c writes chunk c
    arenas   n·A      one per rank, for :meth:`ShmCommunicator.allocate` (zero-copy buckets)

**Protocol.** Each rank counts *steps* (``seq``, one per piece of a collective, the same sequence on
every rank because collectives are called in the same order). A tensor larger than a slot is processed
in pieces that fit. For step k (buffer b = k mod 2) of an all-reduce, rank r:

1. copies its piece into ``slot[b][r]``, then sets ``ARRIVE[r] = k`` (first piece: the call signature
   is written before the flag);
2. waits until ``ARRIVE[j] >= k`` for every j (first piece: compares every rank's signature, so a
   mismatched call raises the same ``ValueError`` everywhere instead of corrupting memory);
3. reduces its 1/n chunk of the piece from every rank's slot with one torch op over a strided
   (n, chunk) view of the slots (``torch.sum(dim=0)``, ``amax``...) into ``result[b]``, then sets
   ``REDUCED[r] = k``;
4. waits until ``REDUCED[j] >= k`` for every j, and copies ``result[b]`` into its tensor.

Small all-reduces (``SMALL_BYTES``) skip 3–4: after step 2 every rank reduces the whole piece itself,
one barrier instead of two. reduce_scatter is 1–2 and then reduces its own chunk straight into the
output; all_gather and broadcast are 1–2 and then copy out of the slots. Every step starts with the
ARRIVE barrier, and that is what makes the two buffers safe to reuse without another flag: rank r
writes ``slot[b][r]`` (and ``result[b]``) again at step k+2 only after it has seen ``ARRIVE[j] >= k+1``
for every j, and rank j raises ARRIVE to k+1 only after it has finished every read of step k. The same
argument lets a fast rank copy in piece k+1 while slow ranks still read piece k (pipelining across
ranks). The zero-copy arena is the exception (the caller writes it at will after the call), so
:meth:`all_reduce_inplace_slot` ends with a third barrier on ``DONE``.

**Direct path** (cross-memory attach). Where the kernel allows it, tensors above 256 KiB may skip the
slots; which path a call takes is measured per collective and power-of-two size class on the first calls
of each (:mod:`.tune`: the slots' ``memcpy`` wins while the tensors are in cache on some hosts, the
direct path's fewer bytes on others), or fixed by ``direct_min_bytes``. On the direct path each rank
publishes its tensor's address in its header line with ARRIVE, and the others copy straight out of its
address space with ``process_vm_readv(2)`` (one kernel copy, as MPI implementations do on one host).
all_reduce: rank r reads block by block every peer's chunk r into a private cache-sized buffer, combines
it with its own chunk in place, and writes the reduced block back into every peer's chunk r with
``process_vm_writev(2)`` while it is in cache; then a ``DONE`` barrier (after it no peer reads or writes
this rank's memory). Chunk r of every rank's tensor is touched by rank r alone, so no other barrier is
needed. Per rank that is
(n−1)/n·S read in, S/n reduced, (n−1)/n·S written out, against the slots' copy in (S), reduction and copy
out (S). reduce_scatter and all_gather read the peers' inputs the same way; broadcast reads the root's
tensor. Whether the direct path is available at all is decided once, collectively, when the
communicator is created: every rank must want it (``direct=True``, ``PARATRAIN_SHM_DIRECT`` not ``0``),
all must share one pid namespace, and each must
read (and write back) a probe word of the next rank successfully. Same-user processes may read each other
unless Yama's ``ptrace_scope`` forbids it; at scope 1 every rank allows its peers with
``prctl(PR_SET_PTRACER_ANY)`` (scope 2 and 3 refuse, and the slots are used). A peer that dies mid-call
makes the read fail with ``ESRCH``, which names it.

**Waiting.** A rank polls the flags it waits for: a few µs of pure spinning, then ``sched_yield`` for
up to ``YIELD_S``, then it blocks in ``futex(FUTEX_WAIT)`` on the first late rank's flag word, and every
publisher calls ``FUTEX_WAKE`` on its flag after raising it (the kernel rechecks the value under its own
lock, so no wake-up is lost). With more ranks than cores (4–5 ranks on 2 cores), pure spinning
would starve the very peers a rank waits for, and sleep-polling (the fallback without futex, sleeps
doubling from ``NAP_MIN_S`` to ``NAP_MAX_S``) adds its nap to every late arrival. While blocked it
checks, every ``CHECK_S``, whether a late rank has died (``/proc/<pid>``, guarded against pid reuse by
the start time) or given up (its STATUS word), and raises naming it; after ``timeout_s``
(default: the process group's timeout) it raises ``TimeoutError("shm all_reduce #k: rank 2 did not
arrive within 30 s ...")``. A rank that raised marks itself aborted, so its peers fail fast too; the
communicator is unusable afterwards (collective state is lost), like a process group after a timeout.

**Memory ordering.** A writer stores the data (torch kernels), then the flag (an aligned numpy int64
store, single-copy atomic on x86-64 and AArch64). A reader sees the flag, then loads the data. On x86-64
(TSO: stores are not reordered with stores, loads not with loads, and the interpreter between the two
C calls is a compiler barrier) that is enough. Other architectures get ``atomic_thread_fence(seq_cst)``
from libatomic before every flag store and after every flag load (release/acquire); a communicator of
two or more ranks refuses to start on a non-x86 machine without libatomic.

**Ops and dtypes.** ``sum mean max min prod`` (comm's ops), ``avg`` (= mean), ``band bor bxor`` (integer
and bool), or the equivalent ``dist.ReduceOp``, and ``PREMUL_SUM`` from
``dist._make_nccl_premul_sum(factor)`` (floats: each rank's input times the factor, then the sum; all_reduce
scales its tensor in place first, reduce and reduce_scatter scale a copy, as their inputs are kept).
Reductions take any dtype torch can reduce on CPU with that op: sums of bf16/fp16 are accumulated in
float32 and rounded once; integers wrap like Gloo's; bool follows Gloo (sum/max/bor = any, prod/min/band
= all, bxor = parity). A dtype/op pair torch has no CPU kernel for (float8, most ops on uint16/32/64) is
refused with a ``TypeError`` before the call starts (tried once on a tiny tensor, then cached), so the
communicator stays usable; all_gather and broadcast only copy, and take any dtype. Any shape, 0-d,
empty, non-contiguous (through a copy).
Tensors on another device are staged through the segment by ``copy_``.

**Hierarchical all-reduce** (:func:`hierarchical_all_reduce`): node-local shm reduce-scatter, a native
all-reduce of the chunk among the ranks with the same local index, node-local shm all-gather.
"""

from paratrain.comm.shm.api import (
    all_gather,
    all_reduce,
    broadcast,
    close_all,
    get_communicator,
    reduce,
    reduce_scatter,
)
from paratrain.comm.shm.communicator import (
    DEFAULT_CAPACITY_BYTES,
    DIRECT_MIN_BYTES,
    OPS,
    SEGMENT_PREFIX,
    SMALL_BYTES,
    ShmCommunicator,
    check_op,
    native_op,
    normalize_op,
    transport_storages,
)
from paratrain.comm.shm.hier import (
    HierarchicalAllReduce,
    hierarchical_all_reduce,
    make_hierarchical_groups,
    node_groups,
)

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DIRECT_MIN_BYTES",
    "OPS",
    "SEGMENT_PREFIX",
    "SMALL_BYTES",
    "HierarchicalAllReduce",
    "ShmCommunicator",
    "all_gather",
    "all_reduce",
    "broadcast",
    "check_op",
    "close_all",
    "get_communicator",
    "hierarchical_all_reduce",
    "make_hierarchical_groups",
    "native_op",
    "node_groups",
    "normalize_op",
    "reduce",
    "reduce_scatter",
    "transport_storages",
]
