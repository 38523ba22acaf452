"""paratrain.comm.shm on 1-4 Gloo ranks: every collective against torch.distributed's own, in the same run.

Three communicator configurations per world: the default (one piece, one-barrier small all-reduce), a
64-element slot with the two-barrier all-reduce (every tensor above 64 elements goes in several pieces,
so both slot buffers and the result buffers are reused many times), and the same tiny slot with the
one-barrier path and sleep-polling waiters instead of futex. Data are small integers (also in float
dtypes), so results must be bit-identical to the backend's whatever the order of reduction; one pass
with random floats uses a tolerance. Then: the
hierarchical all-reduce (4 ranks as 2 "nodes" of 2), the zero-copy arena, the DDP comm hook against
plain DDP, clear errors on every rank, a late rank (timeout naming it) and a SIGKILLed rank (the others
fail fast naming it, and no /dev/shm entry is left).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from paratrain.comm import shm
from paratrain.comm.shm import communicator as shm_communicator
from paratrain.comm.shm import segment as _shm_segment
from paratrain.comm.shm import system as _shm_sys
from paratrain.comm._common import chunk_bounds
from paratrain.testing import call_until_the_last_rank_dies, run_distributed, run_processes

pytestmark = pytest.mark.dist

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int32, torch.int64]
SHAPES = [(), (0,), (1,), (5, 3), (2, 0, 4), (3, 2, 5), (33,), (301,)]  # 0-d, empty, < n, uneven, > slot
NATIVE = {
    "sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}  # fmt: skip
CONFIGS = {
    "default": {},
    "tiny-two-barrier": {"capacity_bytes": 256, "small_bytes": 0},
    "tiny-one-barrier-polling": {"capacity_bytes": 256, "futex": False},  # waiters sleep-poll, no futex
    # the direct path (cross-memory attach) for every size, 64-byte blocks: many blocks per chunk
    "direct-tiny-blocks": {"direct_min_bytes": 0, "direct_block_bytes": 64},
    "slots-only": {"direct": False, "capacity_bytes": 256},
}


def _direct_possible() -> bool:
    """process_vm_readv between sibling processes: refused under Yama ptrace_scope >= 2."""
    try:
        return _shm_sys._VM is not None and int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text()) < 2
    except (OSError, ValueError):
        return _shm_sys._VM is not None


def _ops(dtype: torch.dtype) -> list[str]:
    if dtype.is_floating_point:
        return ["sum", "mean", "max", "min", "prod"]
    return ["sum", "max", "min", "prod", "band", "bor", "bxor"]


def _data(shape: tuple[int, ...], dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    lo, hi = (-2, 3) if op == "prod" else (-6, 7)  # products of up to 5 values in [-2, 2] stay exact
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def _ref_all_reduce(x: torch.Tensor, op: str, group: Any, n: int) -> torch.Tensor:
    ref = x.clone()
    dist.all_reduce(ref, op=NATIVE[op], group=group)
    return ref / n if op == "mean" else ref


def _same(a: Any, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _rs_comm_style(c: shm.ShmCommunicator, x: torch.Tensor, op: str) -> torch.Tensor:
    """comm.reduce_scatter's semantics (``tensor_split`` part along dim 0) on a given communicator."""
    rows = chunk_bounds(x.shape[0], c.size)
    unit = x[0].numel() if x.shape[0] else 0
    out = torch.empty((rows[c.rank][1] - rows[c.rank][0], *x.shape[1:]), dtype=x.dtype)
    if x.numel() == 0:
        return out
    return c.reduce_scatter_flat(x, [(a * unit, b * unit) for a, b in rows], op, out)


def _check_config(c: shm.ShmCommunicator, group: Any, ranks: list[int], salt: int) -> tuple[list[str], int]:
    """Every collective × op × dtype on ``c``, against the native collective of ``group``."""
    n, me = c.size, dist.get_rank()
    bad: list[str] = []
    count = 0

    def fail(what: str, x: torch.Tensor) -> None:
        bad.append(f"rank {me}: {what} dtype={x.dtype} shape={tuple(x.shape)}")

    i = salt
    for dtype in [*FLOATS, *INTS, torch.bool]:
        for op in _ops(dtype):
            for j in range(3):  # three shapes per (dtype, op), rotating through SHAPES
                i += 1
                shape = SHAPES[(i + j) % len(SHAPES)]
                x = _data(shape, dtype, op, seed=1000 * i + c.rank)
                if shape == (5, 3):
                    x = x.t()  # non-contiguous
                ref = _ref_all_reduce(x, op, group, n)
                got = c.all_reduce(x.clone(), op)
                count += 1
                if not _same(got, ref):
                    fail(f"all_reduce op={op}", x)
                root = ranks[i % n]
                y = x.clone()
                c.reduce(y, root, op)
                count += 1
                if not (_same(y, ref) if me == root else torch.equal(y, x)):
                    fail(f"reduce op={op} dst={root}", x)
                if x.dim():
                    want = torch.tensor_split(ref, n)[c.rank]
                    before = x.clone()
                    got = _rs_comm_style(c, x, op)
                    count += 1
                    if not (_same(got, want) and torch.equal(x, before)):
                        fail(f"reduce_scatter op={op}", x)
    for dtype in [*FLOATS, *INTS, torch.bool]:
        for j, shape in enumerate(SHAPES):
            i += 1
            x = _data(shape, dtype, "sum", seed=1000 * i + c.rank)
            root = ranks[i % n]
            ref = x.clone()
            dist.broadcast(ref, src=root, group=group)
            y = x.t() if shape == (5, 3) else x.clone()
            c.broadcast(y, root)
            count += 1
            if not _same(y, ref.t() if shape == (5, 3) else ref):
                fail(f"broadcast src={root}", x)
            # torch's semantics: all_gather_into_tensor / reduce_scatter_tensor on flat tensors
            flat = x.reshape(-1)
            gathered = torch.empty(n * flat.numel(), dtype=dtype)
            dist.all_gather_single(gathered, flat, group=group)
            out = torch.full_like(gathered, 7)
            count += 1
            if not _same(c.all_gather(out, flat), gathered):
                fail("all_gather (into tensor)", x)
            inplace = torch.full_like(gathered, 7)  # the input is this rank's slice of the output
            mine = inplace.view(n, -1)[c.rank] if flat.numel() else inplace[:0]
            mine.copy_(flat)
            count += 1
            if not _same(c.all_gather(inplace, mine), gathered):
                fail("all_gather (in place: input is the output's slice)", x)
            op = _ops(dtype)[j % len(_ops(dtype))]
            inp = _data((n * flat.numel(),), dtype, op, seed=77 + i + c.rank)
            want = _ref_all_reduce(inp, op, group, n).view(n, -1)[c.rank]
            got = c.reduce_scatter(torch.empty(flat.numel(), dtype=dtype), inp, op)
            count += 1
            if not _same(got, want):
                fail(f"reduce_scatter (tensor) op={op}", inp)
    g = torch.Generator().manual_seed(5 + c.rank)
    for op in ("sum", "mean"):  # random floats: any reduction order, a tolerance
        x = torch.randn(1000, generator=g)
        ref = _ref_all_reduce(x, op, group, n)
        count += 2
        if not torch.allclose(c.all_reduce(x.clone(), op), ref, rtol=1e-5, atol=1e-6):
            bad.append(f"rank {me}: random all_reduce {op}")
        if not torch.allclose(
            _rs_comm_style(c, x, op), torch.tensor_split(ref, n)[c.rank], rtol=1e-5, atol=1e-6
        ):
            bad.append(f"rank {me}: random reduce_scatter {op}")
    return bad, count


def check_world(members: list[int] | None = None) -> dict[str, Any]:
    group = dist.new_group(members) if members is not None else None
    if members is not None and dist.get_rank() not in members:
        return {"failures": [], "count": 0}
    ranks = members if members is not None else list(range(dist.get_world_size()))
    failures: list[str] = []
    count = 0
    for k, (name, kwargs) in enumerate(CONFIGS.items()):
        with shm.ShmCommunicator(group, **kwargs) as c:  # type: ignore[arg-type]
            expect = {"direct-tiny-blocks": _direct_possible(), "slots-only": False}.get(name, c.direct)
            if c.size > 1 and c.direct != expect:
                failures.append(f"[{name}] direct path {'on' if c.direct else 'off'} unexpectedly")
            bad, cnt = _check_config(c, group, ranks, salt=100 * k)
            failures += [f"[{name}] {b}" for b in bad]
            count += cnt
    # module-level functions (comm's conventions), through the cached communicator of the group
    x = _data((7, 2), torch.float32, "sum", seed=dist.get_rank())
    n = len(ranks)
    if not _same(shm.all_reduce(x.clone(), "mean", group), _ref_all_reduce(x, "mean", group, n)):
        failures.append("module all_reduce")
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    if not _same(shm.all_gather(x, group), torch.cat(parts)):
        failures.append("module all_gather")
    ref = torch.tensor_split(_ref_all_reduce(x, "max", group, n), n)[ranks.index(dist.get_rank())]
    if not _same(shm.reduce_scatter(x, "max", group), ref):
        failures.append("module reduce_scatter")
    y = x.clone()
    shm.broadcast(y, src=ranks[-1], group=group)
    ref = x.clone()
    dist.broadcast(ref, src=ranks[-1], group=group)
    if not _same(y, ref):
        failures.append("module broadcast")
    if shm.get_communicator(group) is not shm.get_communicator(group):
        failures.append("module cache returns a new communicator")
    return {"failures": failures, "count": count}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, pytest.param(5, marks=pytest.mark.slow)])
def test_every_collective_matches_native(world_size: int) -> None:
    for r in run_distributed(check_world, world_size, timeout_s=280):
        assert r["failures"] == []
        assert r["count"] > 500


@pytest.mark.timeout(300)
def test_subgroup_uses_global_src_dst() -> None:
    """Group {1, 2, 3} of 4: group ranks differ from global ones (src/dst are global, as in torch)."""
    results = run_distributed(check_world, 4, args=([1, 2, 3],), timeout_s=280)
    assert results[0]["count"] == 0
    for r in results[1:]:
        assert r["failures"] == []
        assert r["count"] > 500


def test_no_process_group_is_a_world_of_one() -> None:
    assert not dist.is_initialized()
    x = torch.arange(6.0).view(2, 3)
    assert torch.equal(shm.all_reduce(x.clone(), "mean"), x)
    assert torch.equal(shm.all_gather(x), x)
    assert torch.equal(shm.reduce_scatter(x, "sum"), x)
    c = shm.ShmCommunicator()
    t = c.allocate((3,))
    t.fill_(2.0)
    assert torch.equal(c.all_reduce_inplace_slot(t, "sum"), torch.full((3,), 2.0))


# -- hierarchical -----------------------------------------------------------------------------------


def check_hierarchical() -> dict[str, Any]:
    """World 4 as two nodes of two: intra {0,1},{2,3}; inter {0,2},{1,3}; against a world all-reduce."""
    intra, inter = shm.make_hierarchical_groups(2)
    rank = dist.get_rank()
    if dist.get_process_group_ranks(intra) != [rank - rank % 2, rank - rank % 2 + 1]:
        return {"failures": ["intra group"], "count": 0}
    if dist.get_process_group_ranks(inter) != [rank % 2, rank % 2 + 2]:
        return {"failures": ["inter group"], "count": 0}
    shm.get_communicator(intra, capacity_bytes=256, small_bytes=0)  # the cached one: several pieces
    bad, count, i = [], 0, 0
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.bool]:
        for op in _ops(dtype):
            for shape in [(), (0,), (3,), (5, 3), (301,)]:
                i += 1
                x = _data(shape, dtype, op, seed=31 * i + rank)
                if shape == (5, 3):
                    x = x.t()
                ref = _ref_all_reduce(x, op, None, 4)
                got = shm.hierarchical_all_reduce(x.clone(), op, intra, inter)
                count += 1
                if not _same(got, ref):
                    bad.append(f"rank {rank}: hierarchical {op} {dtype} {shape}")
    return {"failures": bad, "count": count}


@pytest.mark.timeout(180)
def test_hierarchical_all_reduce_two_simulated_nodes() -> None:
    for r in run_distributed(check_hierarchical, 4, timeout_s=170):
        assert r["failures"] == []
        assert r["count"] > 100


# -- zero copy --------------------------------------------------------------------------------------


def check_arena() -> dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    shm_communicator.IN_PLACE_BLOCK_BYTES = 512  # a chunk of the first buckets spans several blocks of the in-place reduction
    c = shm.ShmCommunicator(arena_bytes=64 << 10, capacity_bytes=4096)
    shapes = [((1000,), torch.float32), ((3, 7), torch.float64), ((1,), torch.int64), ((33,), torch.bfloat16),
              ((777,), torch.int32), ((301,), torch.bfloat16), ((257,), torch.bool)]  # fmt: skip
    ops = ["mean", "sum", "max", "sum", "prod", "sum", "bor"]
    buckets = [c.allocate(s, d) for s, d in shapes]
    out: dict[str, Any] = {"failures": []}
    for it in range(4):  # refill and reduce again: the DONE barrier makes rewriting safe
        for k, (b, op) in enumerate(zip(buckets, ops, strict=True)):
            x = _data(tuple(b.shape), b.dtype, op, seed=100 * it + 10 * k + rank)
            b.copy_(x)
            ref = _ref_all_reduce(x, op, None, n)
            if c.all_reduce_inplace_slot(b, op) is not b or not _same(b, ref):
                out["failures"].append(f"rank {rank}: iteration {it} bucket {k}")
    # errors, the same on every rank
    for name, call in {
        "offset_mismatch": lambda: c.all_reduce_inplace_slot(buckets[0][: 500 + rank], "sum"),
        "not_in_arena": lambda: c.all_reduce_inplace_slot(torch.ones(4), "sum"),
        "arena_full": lambda: c.allocate((1 << 20,), torch.float32),
    }.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    y = torch.full((3,), float(rank))
    out["after"] = c.all_reduce(y).tolist()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero_copy_arena(world: int) -> None:
    results = run_distributed(check_arena, world, timeout_s=110)
    for r in results:
        assert r["failures"] == []
        assert r["after"] == [sum(range(world))] * 3
        assert "disagree" in r["offset_mismatch"] and "arena offset" in r["offset_mismatch"]
        assert "allocate()" in r["not_in_arena"]
        assert "do not fit in the arena" in r["arena_full"]


# -- the DDP comm hook ------------------------------------------------------------------------------


def ddp_hook_vs_plain(background: bool) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.comm.shm.hook import ShmHookState, shm_allreduce_hook

    rank = dist.get_rank()

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(13, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
            torch.nn.Linear(64, 3),
        )  # fmt: skip

    plain = DDP(net(), bucket_cap_mb=0.005)  # several buckets
    hooked = DDP(net(), bucket_cap_mb=0.005)
    state = ShmHookState.create(background=background)
    hooked.register_comm_hook(state, shm_allreduce_hook)
    opt_a = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(hooked.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    max_diff = 0.0
    for _ in range(3):
        x, y = torch.randn(8, 13, generator=g), torch.randn(8, 3, generator=g)
        for model, opt in ((plain, opt_a), (hooked, opt_b)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        for pa, pb in zip(plain.parameters(), hooked.parameters(), strict=True):
            assert pa.grad is not None and pb.grad is not None
            max_diff = max(max_diff, (pa.grad - pb.grad).abs().max().item())
        opt_a.step()
        opt_b.step()
    state.close()
    params = torch.cat([p.detach().reshape(-1) for p in hooked.parameters()])
    return {"max_grad_diff": max_diff, "params": params}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [True, False])
def test_ddp_comm_hook_matches_plain_ddp(background: bool) -> None:
    r0, r1 = run_distributed(ddp_hook_vs_plain, 2, args=(background,), timeout_s=110)
    assert r0["max_grad_diff"] <= 1e-6 and r1["max_grad_diff"] <= 1e-6
    assert torch.equal(r0["params"], r1["params"])  # the replicas stay identical


# -- errors -----------------------------------------------------------------------------------------


def error_cases() -> dict[str, str]:
    rank, out = dist.get_rank(), {}
    c = shm.ShmCommunicator(timeout_s=20)

    def expect(name: str, call: Any) -> None:
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    expect("shape_mismatch", lambda: c.all_reduce(torch.ones(4 + rank)))
    expect("op_mismatch", lambda: c.all_reduce(torch.ones(4), "max" if rank else "sum"))
    expect("collective_mismatch", lambda: c.broadcast(torch.ones(4)) if rank else c.all_reduce(torch.ones(4)))
    expect("int_mean", lambda: c.all_reduce(torch.ones(4, dtype=torch.int64), "mean"))
    expect("float_band", lambda: c.all_reduce(torch.ones(4), "band"))
    expect("unknown_op", lambda: c.all_reduce(torch.ones(4), "avgg"))
    expect("src_outside", lambda: c.broadcast(torch.ones(2), src=5))
    expect("zero_dim_all_gather", lambda: shm.all_gather(torch.tensor(1.0)))
    expect("bad_rs_sizes", lambda: c.reduce_scatter(torch.empty(3), torch.empty(5)))
    y = torch.full((3,), float(rank + 1))
    c.all_reduce(y, dist.ReduceOp.AVG)
    out["after"] = str(y.tolist())
    return out


@pytest.mark.timeout(60)
def test_clear_errors_on_every_rank_and_group_stays_usable() -> None:
    r0, r1 = run_distributed(error_cases, 2, timeout_s=50)
    assert r0["after"] == r1["after"] == "[1.5, 1.5, 1.5]"
    for name in r0:
        if name != "after":
            assert r0[name] != "no error" and r1[name] != "no error", name
            assert r0[name].split(":")[0] == r1[name].split(":")[0], name
    assert "disagree" in r0["shape_mismatch"] and "4 elements" in r0["shape_mismatch"]
    assert "5 elements" in r0["shape_mismatch"]
    assert "'max'" in r0["op_mismatch"] and "'sum'" in r0["op_mismatch"]
    assert "broadcast" in r0["collective_mismatch"] and "all_reduce" in r0["collective_mismatch"]
    assert r0["int_mean"].startswith("TypeError") and r0["float_band"].startswith("TypeError")
    assert "unknown op 'avgg'" in r0["unknown_op"]
    assert "src=5" in r0["src_outside"]


def other_host() -> str:
    if dist.get_rank() == 1:  # pretend to live elsewhere
        _shm_segment._host_info = lambda: {"host": "elsewhere", "boot": "x", "pidns": 1}  # type: ignore[assignment]
    try:
        shm.ShmCommunicator()
        return "no error"
    except ValueError as e:
        return str(e)


@pytest.mark.timeout(60)
def test_ranks_on_different_hosts_are_refused() -> None:
    job = f"hosttest{uuid.uuid4().hex[:8]}"
    for msg in run_distributed(other_host, 2, timeout_s=50, env={"PARATRAIN_JOB_ID": job}):
        assert "not all on one host" in msg and "elsewhere" in msg
    assert [n for n in os.listdir("/dev/shm") if job in n] == []


# -- PREMUL_SUM (torch.distributed._make_nccl_premul_sum): each input times the factor, then the sum ---------


def premul_sum() -> dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    bad: list[str] = []
    for name, cfg in (("default", {}), ("direct", {"direct_min_bytes": 0}), ("slots", {"direct": False})):
        c = shm.ShmCommunicator(**cfg)
        for factor in (0.5, torch.tensor([2.0]), -4.0):
            op = dist._make_nccl_premul_sum(factor)
            f = float(factor) if not isinstance(factor, torch.Tensor) else factor.item()
            for dtype in (torch.float32, torch.float64, torch.bfloat16):
                x = _data((7, 301), dtype, "sum", seed=rank + 7 * n)
                expect = x * f  # Gloo has no PREMUL_SUM: the same sum of scaled inputs
                dist.all_reduce(expect)
                what = f"{name} {dtype} {f}"
                if not _same(c.all_reduce(x.clone(), op), expect):
                    bad.append(f"all_reduce {what}")
                y = x.clone()
                c.reduce(y, dst=1, op=op)
                if not _same(y, expect if rank == 1 else x):  # the others' tensors are unchanged
                    bad.append(f"reduce {what}")
                got = _rs_comm_style(c, x, op)
                if not _same(got, torch.tensor_split(expect, n)[rank]):
                    bad.append(f"reduce_scatter {what}")
        c.close()
    errors = []
    for op, t in ((dist._make_nccl_premul_sum(2.0), torch.ones(4, dtype=torch.int64)), (dist.ReduceOp.PREMUL_SUM, torch.ones(4))):
        try:
            shm.all_reduce(t, op=op)
            errors.append("no error")
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    shm.all_reduce(torch.ones(3))  # still usable
    return {"bad": bad, "errors": errors}


@pytest.mark.timeout(120)
def test_premul_sum_scales_every_input_then_sums() -> None:
    out = run_distributed(premul_sum, 3, timeout_s=110)
    for rank, o in enumerate(out):
        assert o["bad"] == [], (rank, o["bad"])
        assert o["errors"][0].startswith("TypeError: shm all_reduce: PREMUL_SUM needs a floating-point tensor")
        assert o["errors"][1].startswith("ValueError: shm: ReduceOp.PREMUL_SUM needs its factor"), o["errors"]


# -- dtypes torch can only copy, or reduce with some ops (float8, uint16) ---------------------------------


def rare_dtypes() -> dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    c = shm.ShmCommunicator(direct_min_bytes=1 << 10)  # the 300 000-element calls take the direct path
    out: dict[str, Any] = {"refused": [], "bad": []}
    for dtype, op in ((torch.float8_e4m3fn, "max"), (torch.uint16, "sum"), (torch.float8_e5m2, "sum")):
        try:
            c.all_reduce(torch.zeros(300_000, dtype=dtype), op)
            out["refused"].append("no error")
        except TypeError as e:
            out["refused"].append(str(e))
    for size in (5, 300_000):
        bits = torch.randint(0, 1 << 16, (size,), generator=torch.Generator().manual_seed(rank), dtype=torch.int32)
        x = bits.to(torch.uint16)
        every = [torch.zeros_like(bits) for _ in range(n)]
        dist.all_gather(every, bits)
        expect = every[0]
        for b in every[1:]:
            expect = expect ^ b
        if not torch.equal(c.all_reduce(x.clone(), "bxor").to(torch.int32), expect):
            out["bad"].append(f"uint16 bxor {size}")
        f8 = torch.randn(size, generator=torch.Generator().manual_seed(rank)).to(torch.float8_e4m3fn)
        gathered = torch.empty(n * size, dtype=torch.float8_e4m3fn)
        c.all_gather(gathered, f8)
        ref = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
        dist.all_gather(ref, f8.view(torch.uint8))
        if not torch.equal(gathered.view(torch.uint8), torch.cat(ref)):
            out["bad"].append(f"float8 all_gather {size}")
        b = f8.clone()
        c.broadcast(b, src=n - 1)
        dist.broadcast(f8.view(torch.uint8), src=n - 1)
        if not torch.equal(b.view(torch.uint8), f8.view(torch.uint8)):
            out["bad"].append(f"float8 broadcast {size}")
    try:  # the same size in two dtypes of one width: the signatures tell them apart
        c.all_reduce(torch.zeros(64, dtype=torch.uint16 if rank == 0 else torch.int16), "bxor")
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    out["after"] = c.all_reduce(torch.ones(10))[0].item()  # still usable
    return out


@pytest.mark.timeout(120)
def test_dtypes_without_a_kernel_are_refused_up_front_and_copies_of_any_dtype_work() -> None:
    out = run_distributed(rare_dtypes, 2, timeout_s=110)
    for rank, o in enumerate(out):
        assert o["bad"] == [], (rank, o["bad"])
        for msg, what in zip(o["refused"], ("float8_e4m3fn tensors with op='max'", "uint16 tensors with op='sum'",
                                             "float8_e5m2 tensors with op='sum'"), strict=True):  # fmt: skip
            assert msg.startswith("shm all_reduce: torch has no CPU kernel to reduce torch.") and what in msg, msg
        assert "disagree on the call" in o["mismatch"] and "torch.uint16" in o["mismatch"], o["mismatch"]
        assert o["after"] == 2.0


# -- failures: a late rank, a killed rank -----------------------------------------------------------


def late_rank() -> dict[str, Any]:
    rank = dist.get_rank()
    # small_bytes=0: the two-barrier all-reduce, so the late rank also needs the first one's REDUCED flag
    c = shm.ShmCommunicator(timeout_s=1.0, small_bytes=0)
    c.all_reduce(torch.ones(10))
    if rank == 1:
        time.sleep(2.5)
    start = time.monotonic()
    out: dict[str, Any] = {}
    try:
        c.all_reduce(torch.ones(10))
        out["error"] = "no error"
    except (TimeoutError, RuntimeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["elapsed"] = time.monotonic() - start
    try:
        c.all_reduce(torch.ones(10))
        out["again"] = "no error"
    except RuntimeError as e:
        out["again"] = str(e)
    return out


@pytest.mark.timeout(60)
def test_late_rank_times_out_naming_it() -> None:
    r0, r1 = run_distributed(late_rank, 2, timeout_s=50)
    assert r0["error"].startswith("TimeoutError: shm all_reduce #2: rank 1 did not arrive within 1 s")
    assert 0.9 < r0["elapsed"] < 3.0
    # rank 1 arrives after rank 0 gave up: it fails fast (rank 0 marked itself aborted), naming rank 0
    assert r1["error"].startswith("RuntimeError: shm all_reduce #2: rank 0 gave up"), r1["error"]
    assert r1["elapsed"] < 1.0
    assert "unusable" in r0["again"] and "unusable" in r1["again"]


def _kill_worker(rank: int, world: int, init_file: str, job: str, outdir: str) -> None:
    os.environ.update({"PARATRAIN_JOB_ID": job, "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    c = shm.ShmCommunicator(capacity_bytes=4096, small_bytes=0, timeout_s=8.0)
    report: dict[str, Any] = {"name": c.name, "name_exists": os.path.exists(f"/dev/shm/{c.name}")}
    x = torch.ones(50_000)  # 49 pieces of 4 KiB: a call is many steps, so the kill lands mid-collective
    for _ in range(3):
        c.all_reduce(x)
    call_until_the_last_rank_dies(lambda: c.all_reduce(x), rank, world, report, outdir)


@pytest.mark.timeout(90)
def test_killed_rank_fails_the_others_fast_and_leaves_no_segment(tmp_path: Path) -> None:
    job = f"killtest{uuid.uuid4().hex[:8]}"
    world = 3
    codes = run_processes(_kill_worker, world, args=(str(tmp_path / "rdzv"), job, str(tmp_path)), timeout_s=60)
    assert codes[-1] == -signal.SIGKILL
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    for r in reports[:-1]:
        assert "rank 2" in r["error"], r
        assert r["elapsed"] < 8.0 + 2.0, r  # the liveness check usually fires within ~0.1 s
        assert not r["name_exists"]  # unlinked as soon as every rank had mapped it
    assert [n for n in os.listdir("/dev/shm") if job in n] == []


def stale_name_is_swept(dead_pid: int, job: str) -> bool:
    """A name left by a creator killed inside the creation window is removed by the next creation."""
    stale = f"/dev/shm/{shm.SEGMENT_PREFIX}{_shm_sys._pid_namespace()}-{dead_pid}-0badc0de-{job}-g"
    if dist.get_rank() == 0:
        Path(stale).write_bytes(b"\0" * 64)
    dist.barrier()
    with shm.ShmCommunicator():
        return not os.path.exists(stale)


@pytest.mark.timeout(60)
def test_stale_segment_name_is_swept() -> None:
    job = f"sweeptest{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("forkserver")
    p = ctx.Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    assert run_distributed(stale_name_is_swept, 2, args=(p.pid, job), timeout_s=50) == [True, True]
    assert [n for n in os.listdir("/dev/shm") if job in n] == []
