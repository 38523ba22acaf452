"""shm's measured choice between the slots and the direct path, on 2-3 Gloo ranks.

Every tuned collective (all_reduce, reduce_scatter, all_gather, broadcast) at sizes of three classes,
interleaved, through the trials, the static call and past the choice, each result against Gloo's own
collective; the ranks end with the same choices. Then rank 0's measurement decides for every rank, even
when the others measured the opposite (scripted clocks), and the call after the choice takes that path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from paratrain.comm import shm
from paratrain.comm.shm.tune import CALLS, TRIALS
from paratrain.testing import run_distributed
from tests.dist.test_shm import _direct_possible

pytestmark = pytest.mark.dist

SIZES = [(300 << 10) // 4, (1 << 20) // 4 + 5, (3 << 20) // 4]  # float32 elements: three size classes


def every_collective_through_the_tuning() -> dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    c = shm.ShmCommunicator(timeout_s=60)
    bad: list[str] = []
    for i in range(CALLS + 2):
        for numel in SIZES:
            g = torch.Generator().manual_seed(100 * i + rank)
            x = torch.randint(-8, 9, (numel,), generator=g).float()  # small integers: exact sums
            ref = x.clone()
            dist.all_reduce(ref)
            if not torch.equal(c.all_reduce(x.clone()), ref):
                bad.append(f"all_reduce call {i} numel {numel}")
            k = numel // n
            out = torch.empty(k)
            if not torch.equal(c.reduce_scatter(out, x[: n * k]), ref[rank * k : (rank + 1) * k]):
                bad.append(f"reduce_scatter call {i} numel {numel}")
            mine = x[:k].contiguous()
            full = torch.empty(n * k)
            expect = [torch.empty(k) for _ in range(n)]
            dist.all_gather(expect, mine)
            if not torch.equal(c.all_gather(full, mine), torch.cat(expect)):
                bad.append(f"all_gather call {i} numel {numel}")
            root = i % n
            b = x.clone()
            want = x.clone()
            dist.broadcast(want, src=root)
            if not torch.equal(c.broadcast(b, src=root), want):
                bad.append(f"broadcast call {i} numel {numel}")
    paths = c.tuned_paths()
    c.close()
    return {"bad": bad, "paths": paths, "direct": c.direct}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_every_tuned_collective_matches_gloo_and_the_ranks_agree(world: int) -> None:
    if not _direct_possible():
        pytest.skip("process_vm_readv between sibling processes is not allowed here (Yama ptrace_scope >= 2)")
    out = run_distributed(every_collective_through_the_tuning, world, timeout_s=170)
    for r, o in enumerate(out):
        assert o["direct"] is True and o["bad"] == [], (r, o["bad"])
    paths = out[0]["paths"]
    assert all(o["paths"] == paths for o in out), [o["paths"] for o in out]
    # every collective has a choice for each of the three classes (all_gather's output is n times larger)
    assert set(paths) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
    assert all(len(v) == 3 for v in paths.values()), paths
    assert all(p in ("direct", "slots") for v in paths.values() for p in v.values())


def rank0_decides(prefer_direct: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    c = shm.ShmCommunicator(timeout_s=60)
    assert c._tuner is not None
    # trial i is slots for even i, direct for odd i; rank 0 sees `prefer_direct` win, the others the opposite
    wins = prefer_direct if rank == 0 else not prefer_direct
    ticks: list[float] = []
    for i in range(2 * TRIALS):
        direct = i % 2 == 1
        ticks += [10.0 * i, 10.0 * i + (1.0 if direct == wins else 2.0)]
    c._tuner.clock = iter(ticks).__next__  # StopIteration if a call that is no trial were timed
    x = torch.full(((1 << 20) // 4,), float(rank + 1))
    expect = float(sum(range(1, dist.get_world_size() + 1)))
    bad = []
    for i in range(CALLS + 1):
        if not bool((c.all_reduce(x.clone()) == expect).all()):
            bad.append(i)
    c.trace = []  # records each direct all-reduce
    c.all_reduce(x.clone())
    took_direct = len(c.trace) == 1
    paths = c.tuned_paths()
    c.close()
    return {"bad": bad, "paths": paths, "took_direct": took_direct}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prefer_direct", [False, True])
def test_rank0s_measurement_decides_for_every_rank(prefer_direct: bool) -> None:
    if not _direct_possible():
        pytest.skip("process_vm_readv between sibling processes is not allowed here (Yama ptrace_scope >= 2)")
    out = run_distributed(rank0_decides, 3, args=(prefer_direct,), timeout_s=110)
    want = "direct" if prefer_direct else "slots"
    for r, o in enumerate(out):
        assert o["bad"] == [], (r, o["bad"])
        assert o["paths"] == {"all_reduce": {1 << 20: want}}, (r, o["paths"])
        assert o["took_direct"] is prefer_direct, r


def fixed_threshold() -> dict[str, Any]:
    c = shm.ShmCommunicator(direct_min_bytes=0)
    for _ in range(CALLS + 1):
        c.all_reduce(torch.ones(1 << 18))
    out = {"paths": c.tuned_paths(), "tuned": c._tuner is not None}
    c.close()
    return out


@pytest.mark.timeout(60)
def test_an_explicit_direct_min_bytes_fixes_the_path() -> None:
    for o in run_distributed(fixed_threshold, 2, timeout_s=50):
        assert o == {"paths": {}, "tuned": False}


def mismatch_during_the_trials() -> dict[str, Any]:
    """Rank 1 calls with another size (another class) at the third call: every rank raises the mismatch,
    the call is uncounted, and the tuning goes on in step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    c = shm.ShmCommunicator(timeout_s=60)
    errors, bad = [], []
    expect = float(sum(range(1, n + 1)))
    for i in range(CALLS + 3):
        numel = (1 << 20) // 4
        if i == 2 and rank == 1:
            numel = (3 << 20) // 4
        try:
            if not bool((c.all_reduce(torch.full((numel,), float(rank + 1))) == expect).all()):
                bad.append(i)
        except ValueError as e:
            errors.append((i, str(e).splitlines()[0]))
    paths = c.tuned_paths()
    c.close()
    return {"errors": errors, "bad": bad, "paths": paths}


@pytest.mark.timeout(120)
def test_a_mismatched_call_during_the_trials_keeps_the_ranks_in_step() -> None:
    if not _direct_possible():
        pytest.skip("process_vm_readv between sibling processes is not allowed here (Yama ptrace_scope >= 2)")
    out = run_distributed(mismatch_during_the_trials, 2, timeout_s=110)
    for r, o in enumerate(out):
        assert [i for i, _ in o["errors"]] == [2], (r, o["errors"])
        assert "disagree on the call" in o["errors"][0][1], o["errors"]
        assert o["bad"] == [], (r, o["bad"])
    assert out[0]["paths"] == out[1]["paths"] and set(out[0]["paths"]["all_reduce"]) == {1 << 20}, out


def freed_without_the_garbage_collector() -> dict[str, Any]:
    import gc
    import weakref

    gc.disable()  # a reference cycle would keep it (and its process group) alive until the final collection
    try:
        c = shm.ShmCommunicator(timeout_s=30)
        tuned = c._tuner is not None
        for _ in range(CALLS + 1):
            c.all_reduce(torch.ones((1 << 20) // 4))
        ref = weakref.ref(c)
        c.close()
        del c
        alive = ref() is not None
    finally:
        gc.enable()
    return {"tuned": tuned, "alive": alive}


@pytest.mark.timeout(60)
def test_a_dropped_communicator_is_freed_at_once() -> None:
    """A cycle through the communicator left it, and the process group it holds, to the collector at
    interpreter exit, where a Gloo worker thread freeing its last work aborted the process (SIGABRT,
    'terminate called without an active exception') in about a third of `paratrain bench comm` runs."""
    if not _direct_possible():
        pytest.skip("process_vm_readv between sibling processes is not allowed here (Yama ptrace_scope >= 2)")
    for o in run_distributed(freed_without_the_garbage_collector, 2, timeout_s=50):
        assert o == {"tuned": True, "alive": False}


def broadcast_with_slow_receivers() -> dict[str, Any]:
    """Rank 1's work after the ARRIVE barrier costs 50 ms on the slots path and 20 ms on the direct path.
    The slots broadcast returns on the root right after that barrier; unless the trial waits for every rank
    (a DONE barrier), rank 0 times the slots without rank 1's copy and charges it to its next call."""
    import time

    rank = dist.get_rank()
    c = shm.ShmCommunicator(timeout_s=30)
    if rank == 1:
        on_direct = {"now": False}
        check, direct_path = c._check_sig, c._broadcast_direct

        def slow_check(seq: int, sig: Any) -> None:
            check(seq, sig)
            time.sleep(0.02 if on_direct["now"] else 0.05)

        def flagged_direct(flat: torch.Tensor, root: int) -> None:
            on_direct["now"] = True
            try:
                direct_path(flat, root)
            finally:
                on_direct["now"] = False

        c._check_sig, c._broadcast_direct = slow_check, flagged_direct  # type: ignore[method-assign]
    x = torch.full(((4 << 20) // 4,), float(rank))
    for _ in range(CALLS + 1):
        c.broadcast(x, src=0)
    out = {"paths": c.tuned_paths(), "ok": bool((x == 0).all())}
    c.close()
    return out


@pytest.mark.timeout(120)
def test_a_slots_trial_times_the_whole_group() -> None:
    if not _direct_possible():
        pytest.skip("process_vm_readv between sibling processes is not allowed here (Yama ptrace_scope >= 2)")
    for o in run_distributed(broadcast_with_slow_receivers, 2, timeout_s=110):
        assert o == {"paths": {"broadcast": {4 << 20: "direct"}}, "ok": True}


def calls_that_move_nothing() -> dict[str, Any]:
    """all_gather with every part empty (an output that is not empty) makes no step, so no barrier: such
    calls must not be counted, or rank 0's choice could reach the others too late."""
    n = dist.get_world_size()
    c = shm.ShmCommunicator(timeout_s=30)
    out = torch.full(((1 << 20) // 4,), 7.0)
    for _ in range(CALLS + 2):
        c.all_gather_flat(torch.empty(0), [(0, 0)] * n, out)
    res = {"paths": c.tuned_paths(), "untouched": bool((out == 7.0).all())}
    c.close()
    return res


@pytest.mark.timeout(60)
def test_calls_that_move_nothing_are_not_counted() -> None:
    if not _direct_possible():
        pytest.skip("process_vm_readv between sibling processes is not allowed here (Yama ptrace_scope >= 2)")
    for o in run_distributed(calls_that_move_nothing, 3, timeout_s=50):
        assert o == {"paths": {}, "untouched": True}


def one_call_with_a_gpu_tensor() -> dict[str, Any]:
    rank = dist.get_rank()
    numel = (1 << 20) // 4
    c = shm.ShmCommunicator(timeout_s=30)
    results = []
    for i in range(CALLS + 3):
        device = "cuda" if (i == 1 and rank == 1) else "cpu"  # trial 1 (direct) with rank 1's tensor on a GPU
        try:
            got = c.all_reduce(torch.full((numel,), float(rank + 1), device=device))
            results.append("ok" if bool((got.cpu() == 3.0).all()) else "wrong")
        except ValueError as e:
            results.append("mismatch" if "disagree on the call" in str(e) else str(e))
    gathered = c.all_gather(torch.empty(2 * numel), torch.full((numel,), float(rank), device="cuda"))
    out = {"results": results, "paths": c.tuned_paths(), "gathered": gathered.tolist()[::numel]}
    c.close()
    return out


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_a_call_with_a_gpu_tensor_on_one_rank_leaves_the_ranks_in_step() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: one rank's tensor goes on it")
    if not _direct_possible():
        pytest.skip("process_vm_readv between sibling processes is not allowed here (Yama ptrace_scope >= 2)")
    for o in run_distributed(one_call_with_a_gpu_tensor, 2, timeout_s=110):
        # the mixed call is refused on both ranks (rank 0 took the direct path, rank 1 had to take the
        # slots) and counts nothing; every CPU call after it agrees, and the tuning completes
        assert o["results"] == ["ok", "mismatch"] + ["ok"] * (CALLS + 1), o["results"]
        assert set(o["paths"]) == {"all_reduce"}
        assert o["gathered"] == [0.0, 1.0]  # a GPU input with a CPU output goes through the slots
