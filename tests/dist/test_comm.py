"""paratrain.comm on 1-4 Gloo ranks, every result compared with torch.distributed's own, in the same run.

One process group per world size: the rank function loops over every function × algorithm × op × dtype ×
shape itself and returns the list of mismatches, so spawning stays cheap. Data are small integers (also
in float dtypes), so every algorithm's result must be *bit-identical* to the backend's whatever the order
of reduction; a second pass with random floats is compared with a tolerance.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from paratrain import comm
from paratrain.comm import ring
from paratrain.comm._common import chunk_bounds, peers
from paratrain.testing import run_distributed

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16]
SHAPES = [(), (0,), (1,), (5, 3), (2, 0, 4), (3, 2, 5), (33,)]  # 0-d, empty, shorter than n, uneven
NATIVE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}
ROOTED = {"broadcast", "reduce", "gather", "scatter"}


def _data(shape: tuple[int, ...], dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if op == "prod":  # products of 4 values in [-2, 2] stay exact in every dtype
        x = torch.randint(-2, 3, shape, generator=g)
    else:
        x = torch.randint(-6, 7, shape, generator=g)
    return x.to(dtype)


def _native_reduce_ref(x: torch.Tensor, op: str, group: Any, n: int) -> torch.Tensor:
    """The definition: torch.distributed's all_reduce (mean = SUM / n)."""
    ref = x.clone()
    dist.all_reduce(ref, op=NATIVE_OPS[op], group=group)
    return ref / n if op == "mean" else ref


def _same(a: Any, b: torch.Tensor, exact: bool) -> bool:
    if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if exact:
        return torch.equal(a, b)
    return torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)


def _run_case(
    fn: str, alg: str, op: str, x: torch.Tensor, root: int, group: Any, exact: bool, check: bool = True
) -> str | None:
    """Run one call of ``comm.<fn>`` and the native reference; return a description of a mismatch."""
    p = peers(fn, group)
    n, me = p.size, dist.get_rank()
    groot = p.group_rank(root, "root") if fn in ROOTED else 0
    if fn == "all_reduce":
        ref = _native_reduce_ref(x, op, group, n)
        got = comm.all_reduce(x.clone(), op, alg, group, check=check)
        ok = _same(got, ref, exact)
    elif fn == "reduce":
        ref = _native_reduce_ref(x, op, group, n)
        y = x.clone()
        got = comm.reduce(y, root, op, alg, group, check=check)
        ok = got is y and (_same(y, ref, exact) if p.rank == groot else alg == "native" or torch.equal(y, x))
    elif fn == "broadcast":
        ref = x.clone()
        dist.broadcast(ref, src=root, group=group)
        y = x.clone()
        ok = comm.broadcast(y, root, alg, group, check=check) is y and _same(y, ref, True)
    elif fn == "all_gather":
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ok = _same(comm.all_gather(x, alg, group, check=check), torch.cat(parts), True)
    elif fn == "reduce_scatter":
        ref = torch.tensor_split(_native_reduce_ref(x, op, group, n), n)[p.rank]
        before = x.clone()
        ok = _same(comm.reduce_scatter(x, op, alg, group, check=check), ref, exact) and torch.equal(x, before)
    elif fn == "gather":
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        got = comm.gather(x, root, alg, group, check=check)
        if p.rank != groot:
            ok = got is None
        else:
            ok = (
                got is not None
                and len(got) == n
                and all(_same(a, b, True) for a, b in zip(got, parts, strict=True))
            )
    elif fn == "scatter":
        whole = torch.cat([x.reshape(-1)] * 3) if x.dim() else x.reshape(1).repeat(n + 1)
        dist.broadcast(whole, src=root, group=group)  # reference: src's tensor, natively
        chunks = list(torch.tensor_split(whole, n))
        if alg == "native":  # dist.scatter needs one shape: cut the uneven tail off
            chunks = [c[: len(chunks[-1])] for c in chunks]
        got = comm.scatter(chunks if p.rank == groot else None, root, alg, group)
        ok = _same(got, chunks[p.rank], True)
    else:
        raise AssertionError(fn)
    if ok:
        return None
    return f"rank {me}: {fn} alg={alg} op={op} dtype={x.dtype} shape={tuple(x.shape)} root={root}"


def _cases() -> list[tuple[str, str, str]]:
    out = []
    for fn, algs in comm.ALGORITHMS.items():
        if fn == "all_to_all":  # uneven splits per rank: its own test against Gloo's (tests/dist/test_alltoall.py)
            continue
        ops = comm.OPS if fn in ("all_reduce", "reduce", "reduce_scatter") else ("-",)
        out += [(fn, alg, op) for alg in algs for op in ops]
    return out


def check_world(members: list[int] | None = None) -> dict[str, Any]:
    """Every function × algorithm × op × dtype × shape; ``members``: run inside that sub-group instead."""
    group = dist.new_group(members) if members is not None else None
    if members is not None and dist.get_rank() not in members:
        return {"failures": [], "count": 0}
    p = peers("test", group)
    # On Gloo the messages go through the group's Gloo backend object (not through the dispatcher), so
    # every case below checks that path.
    assert type(p.p2p).__name__ == "ProcessGroupGloo", p.p2p
    ranks = members if members is not None else list(range(p.size))
    failures, count, i = [], 0, 0
    for k, (fn, alg, op) in enumerate(_cases()):
        # Every shape, with the dtype rotating so that each combination sees every dtype about twice.
        for j, shape in enumerate(SHAPES):
            dtype = DTYPES[(j + k) % len(DTYPES)]
            if op == "mean" and not dtype.is_floating_point:
                dtype = torch.bfloat16 if dtype == torch.int32 else torch.float64
            if fn in ("all_gather", "reduce_scatter") and shape == ():
                shape = (2,)
            i += 1
            root = ranks[i % len(ranks)]  # src/dst are global ranks; rotate through the group
            x = _data(shape, dtype, op, seed=1000 * i + p.rank)
            if shape == (5, 3) and fn in ("broadcast", "reduce", "all_reduce"):
                x = x.t()  # non-contiguous, in place: written back through a copy
            # The consistency check (one extra collective) on every third call: it must not change results.
            failures.append(_run_case(fn, alg, op if op != "-" else "sum", x, root, group, True, i % 3 == 0))
            count += 1
        if op in ("sum", "mean", "-"):  # random floats: any reduction order, tolerance
            x = torch.randn(6, 5, generator=torch.Generator().manual_seed(7 + p.rank))
            failures.append(_run_case(fn, alg, op if op != "-" else "sum", x, ranks[0], group, exact=False))
            count += 1
    if members is None:
        failures += check_ring_pieces()
    return {"failures": [f for f in failures if f], "count": count}


def check_ring_pieces() -> list[str]:
    """The ring with tiny pieces, so every chunk is cut in several pipelined pieces of uneven size, and
    with a receive window of 2, 3 or all slots (the window is reused round-robin)."""
    p, bad = peers("test", None), []
    for numel, (piece, scratch), op in itertools.product(
        [1, 5, 37, 130], [(4, 8), (4, 12), (12, 1 << 20)], comm.OPS
    ):
        x = _data((numel,), torch.float64, op, seed=numel + p.rank)
        ref = _native_reduce_ref(x, op, None, p.size)
        y = x.clone()
        ring.all_reduce(y, op, p, piece_bytes=piece, scratch_bytes=scratch)
        if not torch.equal(y, ref):
            bad.append(
                f"rank {p.rank}: ring all_reduce numel={numel} piece={piece} scratch={scratch} op={op}"
            )
        bounds = chunk_bounds(numel, p.size)
        got = ring.reduce_scatter(x.clone(), bounds, op, p, piece_bytes=piece, scratch_bytes=scratch)
        if not torch.equal(got, ref[bounds[p.rank][0] : bounds[p.rank][1]]):
            bad.append(
                f"rank {p.rank}: ring reduce_scatter numel={numel} piece={piece} scratch={scratch} op={op}"
            )
        mine = torch.arange(numel, dtype=torch.float64) + 1000 * p.rank
        parts = [torch.empty_like(mine) for _ in range(p.size)]
        dist.all_gather(parts, mine)
        out = torch.zeros(numel * p.size, dtype=torch.float64)
        ag_bounds = [(r * numel, (r + 1) * numel) for r in range(p.size)]
        out[ag_bounds[p.rank][0] : ag_bounds[p.rank][1]] = mine
        ring.all_gather(out, ag_bounds, p, piece_bytes=piece)
        if not torch.equal(out, torch.cat(parts)):
            bad.append(f"rank {p.rank}: ring all_gather numel={numel} piece={piece}")
    # a chunk that fits in one piece but is above min_pipelined_bytes is still cut in two
    for numel in (9, 130):
        x = _data((numel,), torch.float64, "sum", seed=numel + p.rank)
        y = x.clone()
        ring.all_reduce(y, "sum", p, min_pipelined_bytes=16)
        if not torch.equal(y, _native_reduce_ref(x, "sum", None, p.size)):
            bad.append(f"rank {p.rank}: ring all_reduce numel={numel}, depth-2 pipelining")
    return bad


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_function_matches_native(world_size: int) -> None:
    results = run_distributed(check_world, world_size, timeout_s=110)
    for r in results:
        assert r["failures"] == []
        assert r["count"] > 400


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_subgroup_uses_global_src_dst() -> None:
    # Group {1, 2, 3} of a world of 4: group ranks differ from global ones, and its size (3) is not a power of 2.
    results = run_distributed(check_world, 4, args=([1, 2, 3],), timeout_s=110)
    assert results[0]["count"] == 0
    for r in results[1:]:
        assert r["failures"] == []
        assert r["count"] > 400


def seed_example(algorithm: str) -> dict[str, float]:
    """Seed 003's toy model: param 2.0, rank r's input r, loss (r − param)², all-reduce SUM, SGD lr 0.1."""
    rank = dist.get_rank()
    param = torch.nn.Parameter(torch.tensor([2.0]))
    optimizer = torch.optim.SGD([param], lr=0.1)
    loss = (torch.tensor([float(rank)]) - param).pow(2).sum()
    loss.backward()
    assert param.grad is not None
    before = param.grad.item()
    comm.all_reduce(param.grad, op="sum", algorithm=algorithm)  # the seed sums; it does not average
    after = param.grad.item()
    optimizer.step()
    return {"grad_before": before, "grad_after": after, "param": param.item()}


def seed_examples() -> dict[str, dict[str, float]]:
    return {alg: seed_example(alg) for alg in comm.ALGORITHMS["all_reduce"]}


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_seed_worked_example() -> None:
    """Gradients 4 and 2, all-reduce SUM gives 6 on both ranks, SGD lr 0.1 takes 2.0 to 1.4: every algorithm."""
    r0, r1 = run_distributed(seed_examples, 2, timeout_s=50)
    for alg in comm.ALGORITHMS["all_reduce"]:
        assert (r0[alg]["grad_before"], r1[alg]["grad_before"]) == (4.0, 2.0), alg
        assert (r0[alg]["grad_after"], r1[alg]["grad_after"]) == (6.0, 6.0), alg
        assert r0[alg]["param"] == pytest.approx(1.4) and r1[alg]["param"] == pytest.approx(1.4), alg


def error_cases() -> dict[str, str]:
    """Each bad call must raise the same kind of error on every rank, and leave the group usable."""
    rank, out = dist.get_rank(), {}

    def expect(name: str, call: Any) -> None:
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    x = torch.ones(4)
    expect("unknown_algorithm", lambda: comm.all_reduce(x, algorithm="butterfly"))
    expect("algorithm_not_for_fn", lambda: comm.broadcast(x, algorithm="ring"))
    expect("unknown_op", lambda: comm.all_reduce(x, op="avg"))
    expect("int_mean", lambda: comm.all_reduce(torch.ones(4, dtype=torch.int64), op="mean", algorithm="ring"))
    expect("bool_sum", lambda: comm.reduce(torch.ones(2, dtype=torch.bool)))
    expect("shape_mismatch", lambda: comm.all_reduce(torch.ones(4 + rank), algorithm="ring"))
    expect(
        "dtype_mismatch",
        lambda: comm.all_gather(torch.ones(2, dtype=torch.float64 if rank else torch.float32)),
    )
    expect("algorithm_mismatch", lambda: comm.all_reduce(torch.ones(3), algorithm="ring" if rank else "tree"))
    expect("src_outside", lambda: comm.broadcast(x, src=5))
    expect("zero_dim_all_gather", lambda: comm.all_gather(torch.tensor(1.0)))
    expect("scatter_bad_chunks", lambda: comm.scatter([torch.ones(2)] if rank == 0 else None, src=0))
    uneven = [torch.ones(2), torch.ones(3)] if rank == 0 else None
    expect("scatter_native_uneven", lambda: comm.scatter(uneven, src=0, algorithm="native"))
    y = torch.full((3,), float(rank + 1))
    comm.all_reduce(y, algorithm="ring")
    out["after"] = str(y.tolist())
    return out


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_clear_errors_on_every_rank() -> None:
    r0, r1 = run_distributed(error_cases, 2, timeout_s=50)
    assert r0["after"] == r1["after"] == "[3.0, 3.0, 3.0]"
    for name in r0:
        if name == "after":
            continue
        assert r0[name] != "no error" and r1[name] != "no error", name
        assert r0[name].split(":")[0] == r1[name].split(":")[0], name
    assert "unknown algorithm 'butterfly'" in r0["unknown_algorithm"]
    assert "'ring'" in r0["algorithm_not_for_fn"]
    assert "unknown op 'avg'" in r0["unknown_op"]
    assert r0["int_mean"].startswith("TypeError") and "floating-point" in r0["int_mean"]
    assert r0["bool_sum"].startswith("TypeError")
    assert "shape (4,)" in r0["shape_mismatch"] and "shape (5,)" in r0["shape_mismatch"]
    assert "torch.float32" in r1["dtype_mismatch"] and "torch.float64" in r1["dtype_mismatch"]
    assert "'tree'" in r0["algorithm_mismatch"] and "'ring'" in r0["algorithm_mismatch"]
    assert "src=5" in r0["src_outside"]
    assert "one tensor per rank" in r0["scatter_bad_chunks"] and "source rank 0" in r1["scatter_bad_chunks"]
    assert "one shape" in r0["scatter_native_uneven"]
