"""``scatter``: the one collective where the receivers do not know what they will get.

Only ``src`` holds the chunks, so the other ranks cannot size a receive buffer. The schedule is therefore
two messages per rank: first a small int64 header ``[status, dtype code, ndim, dims...]``, then the data.

- ``naive``: ``src`` ``isend``s every rank its own header, then its own chunk (all posted at once); each
  rank waits for its header, allocates, and receives. Chunks may have different shapes (for example the
  parts of ``torch.tensor_split``, which differ by a row).
- ``native``: ``src`` broadcasts the table of all headers (``dist.broadcast``), then ``dist.scatter``
  moves the data. The backend's scatter needs chunks of one shape.

A bad chunk list is found on ``src`` only. Rather than raising there and leaving the others waiting for
a header until the timeout, ``src`` sends a header with status 1 and *then* raises; every other rank
raises a ``ValueError`` that points at ``src``.

α–β cost (n ranks, S = all chunks together): (n−1)(2α + Sβ/n) for ``naive`` (the root's link serialises).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm._check import check_algorithm, dtype_code, dtype_from_code
from paratrain.comm._common import default_device, peers, wait_all
from paratrain.comm.naive import scatter_from

_MAX_DIMS = 16
_HEADER = 3 + _MAX_DIMS


def _problem(chunks: Any, size: int, algorithm: str) -> str | None:
    """What is wrong with ``chunks`` on ``src`` (``None``: nothing)."""
    if not isinstance(chunks, Sequence) or isinstance(chunks, torch.Tensor):
        return f"chunks must be a list of {size} tensors on src, got {type(chunks).__name__}"
    if len(chunks) != size:
        return f"chunks must hold one tensor per rank of the group ({size}), got {len(chunks)}"
    if not all(isinstance(c, torch.Tensor) for c in chunks):
        return "every chunk must be a torch.Tensor"
    first = chunks[0]
    if any(c.dtype != first.dtype or c.device != first.device for c in chunks):
        return "every chunk must have the same dtype and device"
    if dtype_code(first.dtype) < 0:
        return f"dtype {first.dtype} is not supported"
    if any(c.dim() > _MAX_DIMS for c in chunks):
        return f"chunks may have at most {_MAX_DIMS} dims"
    if algorithm == "native" and any(c.shape != first.shape for c in chunks):
        return "algorithm='native' (dist.scatter) needs chunks of one shape; use algorithm='naive' for uneven ones"
    return None


def _header(chunk: torch.Tensor | None) -> list[int]:
    if chunk is None:  # status 1: src rejected its chunks
        return [1] + [0] * (_HEADER - 1)
    shape = list(chunk.shape)
    return [0, dtype_code(chunk.dtype), len(shape), *shape, *([0] * (_MAX_DIMS - len(shape)))]


@torch.no_grad()
def scatter(
    chunks: Sequence[torch.Tensor] | None,
    src: int = 0,
    algorithm: str = "naive",
    group: Any = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Send ``chunks[r]`` from global rank ``src`` to group rank r; return this rank's chunk (a new tensor).

    ``chunks`` is read on ``src`` only (pass ``None`` elsewhere). The result lands on ``device``: by default
    the chunks' device on ``src`` and the backend's device elsewhere (CPU for Gloo, the current CUDA
    device for NCCL).
    """
    check_algorithm("scatter", algorithm)
    p = peers("scatter", group)
    root = p.group_rank(src, "src")
    is_root = p.rank == root
    problem = _problem(chunks, p.size, algorithm) if is_root else None
    good = chunks if is_root and problem is None else None
    if device is not None:
        dev = torch.device(device)
    elif good is not None:
        dev = good[0].device
    else:
        dev = default_device(p)
    if p.size == 1:
        if problem is not None:
            raise ValueError(f"scatter: {problem}.")
        assert good is not None
        return good[0].to(dev, copy=True)

    # -- message 1: headers -------------------------------------------------------------------------------
    if algorithm == "native":
        table = torch.zeros(p.size, _HEADER, dtype=torch.int64, device=dev)
        if is_root:
            rows = [_header(good[r] if good is not None else None) for r in range(p.size)]
            table.copy_(torch.tensor(rows, dtype=torch.int64))
        dist.broadcast(table, src=src, group=group)
        header = table[p.rank].tolist()
    elif is_root:
        rows = [_header(good[r] if good is not None else None) for r in range(p.size)]
        headers = torch.tensor(rows, dtype=torch.int64, device=dev)
        wait_all([p.isend(headers[r], r) for r in range(p.size) if r != root])
        header = rows[root]
    else:
        incoming = torch.empty(_HEADER, dtype=torch.int64, device=dev)
        p.irecv(incoming, root).wait()
        header = incoming.tolist()
    if header[0] != 0:
        detail = problem if is_root else f"source rank {src} rejected its chunks (see the error raised there)"
        raise ValueError(f"scatter: {detail}.")

    # -- message 2: the data ------------------------------------------------------------------------------
    ndim = header[2]
    out = torch.empty(header[3 : 3 + ndim], dtype=dtype_from_code(header[1]), device=dev)
    parts = [c.contiguous() for c in good] if good is not None else []
    if algorithm == "native":
        if out.numel() > 0:
            dist.scatter(out, scatter_list=parts if is_root else None, src=src, group=group)
    else:
        scatter_from([c.view(-1) for c in parts], out.view(-1), root, p)
    return out
