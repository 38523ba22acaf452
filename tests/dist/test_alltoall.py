"""``paratrain.comm.all_to_all`` (pairwise send/recv, and native) against Gloo's ``all_to_all_single``.

World sizes 2-5; per world, the rank function loops over dtypes and split patterns (uneven, empty blocks,
a rank that sends nothing, a rank that receives nothing, row shapes of 1 and 2 dims) and returns its
mismatches. The data are distinct integers, so the result must be bit-identical.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from paratrain import comm
from paratrain.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _splits(pattern: str, n: int, rank: int) -> list[int]:
    """Rows rank ``rank`` sends to each rank under ``pattern``."""
    if pattern == "uneven":
        return [(rank * 3 + j * 2) % 5 for j in range(n)]
    if pattern == "empty":  # every block empty
        return [0] * n
    if pattern == "one-sender":  # only rank 0 sends; rank n-1 receives nothing
        return [(j + 1) * int(rank == 0 and j != n - 1) for j in range(n)]
    return [2] * n  # even


def _rank(n: int) -> list[str]:
    rank = dist.get_rank()
    bad = []
    for dtype in DTYPES:
        for pattern in ("uneven", "empty", "one-sender", "even"):
            for row in ((), (3,)):
                send = _splits(pattern, n, rank)
                recv = [_splits(pattern, n, r)[rank] for r in range(n)]
                width = row[0] if row else 1
                x = (torch.arange(sum(send) * width) + 1000 * rank).view(sum(send), *row).to(dtype)
                ref = x.new_empty((sum(recv), *row))
                dist.all_to_all_single(ref, x, output_split_sizes=recv, input_split_sizes=send)
                for alg in ("pairwise", "native"):
                    got = comm.all_to_all(x, recv, send, algorithm=alg)
                    if not torch.equal(got, ref):
                        bad.append(f"{alg} {dtype} {pattern} row{row}")
                    counted = comm.all_to_all(x, None, send, algorithm=alg, check=False)  # counts exchanged
                    if not torch.equal(counted, ref):
                        bad.append(f"{alg} {dtype} {pattern} row{row} counts exchanged")
    return bad


def _wrong_splits() -> str:
    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.zeros(n)
    recv = [1] * n
    if rank == 1:
        recv[0] = 2  # rank 1 expects a row too many from rank 0
    try:
        comm.all_to_all(x, recv, [1] * n)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_all_to_all_matches_gloo(world_size: int) -> None:
    results = run_distributed(_rank, world_size, args=(world_size,), timeout_s=100)
    assert results == [[]] * world_size


def test_all_to_all_refuses_disagreeing_splits_on_every_rank() -> None:
    msgs: list[Any] = run_distributed(_wrong_splits, 3, timeout_s=60)
    assert all("disagree with what the peers send on rank(s) [1]" in m for m in msgs), msgs


def test_all_to_all_without_a_process_group() -> None:
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(comm.all_to_all(x), x)
    with pytest.raises(ValueError, match="input_split_sizes"):
        comm.all_to_all(x, None, [2])
