"""The group view every algorithm talks through (:class:`Peers`), chunk bounds and p2p helpers.

Every algorithm module (``naive``, ``tree``, ``ring``, ``rhd``) talks to its peers only through
:class:`Peers`, which works in *group* ranks (0..size-1 inside ``group``) and translates to global ranks
at the last moment, because ``torch.distributed.isend``/``irecv`` address peers by global rank.

Point-to-point is always non-blocking (``isend``/``irecv``) and every algorithm waits explicitly on the
handles it needs, which is what makes the schedules deadlock-free: no rank ever blocks in a send while
its peer blocks in a send to it. Two ranks that send to each other in the same step go through
:meth:`Peers.exchange`, which on NCCL issues both ops as one ``batch_isend_irecv`` group (NCCL executes
ungrouped p2p on one stream in issue order, so a bare send/recv pair in opposite orders would deadlock).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paratrain.runtime import install_exit_grace


def wait_all(works: Iterable[Any]) -> None:
    """Wait on every handle (``None`` entries, which torch returns outside the group, are skipped)."""
    for w in works:
        if w is not None:
            w.wait()


@dataclass(frozen=True)
class Peers:
    """This rank's view of a group: its group rank, the group size, and p2p addressed by group rank."""

    group: Any
    """The ``group`` argument as given (``None``: the default group)."""
    pg: Any
    """The resolved ``ProcessGroup`` (``None`` without a process group)."""
    rank: int
    size: int
    batched: bool
    """Issue paired send/recv as one ``batch_isend_irecv`` (NCCL); Gloo issues them separately."""
    p2p: Any = None
    """What ``isend``/``irecv`` call: the group's Gloo backend itself when there is one, else ``pg``."""

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.GroupMember.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def group_rank(self, global_rank: int, what: str) -> int:
        """Translate a ``src``/``dst`` argument (a global rank, as in torch) into a group rank."""
        if self.group is None or self.group is dist.GroupMember.WORLD:
            if not 0 <= global_rank < self.size:
                raise ValueError(f"{what}={global_rank} is not a rank of a world of size {self.size}.")
            return global_rank
        try:
            return dist.get_group_rank(self.group, global_rank)
        except (ValueError, RuntimeError):
            members = [self.global_rank(r) for r in range(self.size)]
            raise ValueError(
                f"{what}={global_rank} is not in the group (global ranks {members}); like torch.distributed, "
                f"{what} is a global rank."
            ) from None

    # ``ProcessGroup.send``/``recv`` are what ``dist.isend``/``irecv`` call after their argument checks;
    # calling them directly (with group ranks) saves tens of microseconds per message, which matters
    # for the ring's pipelined pieces. On Gloo the backend's own ``send``/``recv`` skip the operator
    # dispatcher too (about 8 us of CPU per message, measured on a 4-byte round trip; the cost is that a
    # torch profile shows no ``c10d::send`` entries for them). Complex tensors travel as their real view,
    # as in torch.
    def isend(self, tensor: torch.Tensor, to: int, tag: int = 0) -> Any:
        via = self.pg if self.p2p is None else self.p2p
        return via.send([torch.view_as_real(tensor) if tensor.is_complex() else tensor], to, tag)

    def irecv(self, tensor: torch.Tensor, frm: int, tag: int = 0) -> Any:
        via = self.pg if self.p2p is None else self.p2p
        return via.recv([torch.view_as_real(tensor) if tensor.is_complex() else tensor], frm, tag)

    def exchange(
        self,
        send: torch.Tensor | None,
        to: int,
        recv: torch.Tensor | None,
        frm: int,
        tag: int = 0,
    ) -> tuple[list[Any], list[Any]]:
        """Post a send and a receive together; return ``(send_works, recv_works)``.

        Empty or missing tensors are skipped (the peer skips the matching op, since it knows the size).
        On NCCL both ops form one group and share a single handle, so both lists hold that handle.
        """
        send = send if send is not None and send.numel() > 0 else None
        recv = recv if recv is not None and recv.numel() > 0 else None
        if self.batched and send is not None and recv is not None:
            ops = [
                dist.P2POp(dist.isend, send, group=self.group, tag=tag, group_peer=to),
                dist.P2POp(dist.irecv, recv, group=self.group, tag=tag, group_peer=frm),
            ]
            works = dist.batch_isend_irecv(ops)
            return works, works
        sends = [self.isend(send, to, tag)] if send is not None else []
        recvs = [self.irecv(recv, frm, tag)] if recv is not None else []
        return sends, recvs


def peers(function: str, group: Any) -> Peers:
    """Resolve ``group`` for this rank. Without a process group this is a world of size 1."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError(f"{function}: a group was given but no process group is initialised.")
        return Peers(None, None, 0, 1, False)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{function}: global rank {dist.get_rank()} is not a member of the given group; only members "
            "may call a collective on it."
        )
    pg = group if group is not None else dist.group.WORLD
    backend = str(dist.get_backend(group))
    if backend == "gloo":
        install_exit_grace()  # a script using paratrain.comm without paratrain.init: see runtime
    return Peers(group, pg, rank, dist.get_world_size(group), backend != "gloo", _gloo_backend(pg, backend))


def _gloo_backend(pg: Any, backend: str) -> Any:
    """The Gloo backend object of a Gloo-only group (its ``send``/``recv`` skip the dispatcher), or None."""
    if backend != "gloo":
        return None
    try:
        return pg._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, ValueError):  # not exposed by this torch: go through the group
        return None


def contiguous_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor to run an in-place algorithm on: ``tensor`` itself, or a copy to write back."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def chunk_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of ``torch.tensor_split(range(total), parts)``.

    The first ``total % parts`` ranges are one longer; some are empty when ``total < parts``.
    """
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def default_device(peers: Peers) -> torch.device:
    """Where a rank that has no input tensor (scatter) puts its output: the backend's device."""
    if peers.batched and torch.cuda.is_available():  # NCCL (and other GPU backends) move CUDA tensors
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
