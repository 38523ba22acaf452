"""The shm path tuner's bookkeeping, without a process group: trials, rank 0's published choice, the
other ranks reading it one call later, the size classes."""

from __future__ import annotations

import numpy as np
import pytest

from paratrain.comm.shm import tune as _shm_tune
from paratrain.comm.shm.tune import CALLS, TRIALS, PathTuner

MIN = 256 << 10


def _tuners(n: int) -> tuple[np.ndarray, list[PathTuner]]:
    words = np.zeros(len(_shm_tune.FUNCTIONS), dtype=np.int64)  # stands for rank 0's header words
    return words, [PathTuner(r, words, 2 << 20, MIN) for r in range(n)]


def _call(tuner: PathTuner, function: str, nbytes: int, seconds: dict[bool, float] | None) -> bool:
    """One call that succeeds: picked, then counted (timed when it is a trial and ``seconds`` is given)."""
    direct, ticket = tuner.pick(function, nbytes)
    if ticket is not None:
        timed = seconds is not None and tuner.is_trial(ticket)
        tuner.done(ticket, direct, seconds[direct] if timed and seconds is not None else None)
    return direct


@pytest.mark.parametrize("faster", [False, True])
def test_rank0_choice_is_every_ranks_choice_from_the_call_after_the_static_one(faster: bool) -> None:
    words, (t0, t1) = _tuners(2)
    fast, slow = 1e-3, 2e-3
    mine = {faster: fast, not faster: slow}  # rank 0 measures `faster` as the faster path
    theirs = {faster: slow, not faster: fast}  # rank 1 would have chosen the other one
    paths0, paths1 = [], []
    for _ in range(CALLS + 3):  # the ranks take turns call by call, as the ARRIVE barrier makes them
        paths0.append(_call(t0, "all_reduce", 1 << 20, mine))
        paths1.append(_call(t1, "all_reduce", 1 << 20, theirs))
    trials = [i % 2 == 1 for i in range(2 * TRIALS)]  # slots, direct, slots, ...
    static = (1 << 20) > 2 << 20  # the rule before the choice: slots at 1 MiB
    assert paths0 == paths1 == [*trials, static, faster, faster, faster]
    assert t0.decisions() == t1.decisions() == {"all_reduce": {1 << 20: "direct" if faster else "slots"}}
    assert int(words[0]) != 0 and int(words[1:].sum()) == 0  # all_reduce's word only


def test_classes_and_collectives_are_tuned_apart_and_small_sizes_never_direct() -> None:
    _, (t0, t1) = _tuners(2)
    slower_direct = {False: 1e-3, True: 5e-3}
    faster_direct = {False: 5e-3, True: 1e-3}
    for _ in range(CALLS + 1):
        for t in (t0, t1):
            assert _call(t, "all_reduce", MIN, faster_direct) is False  # at the threshold: slots, untimed
            _call(t, "all_reduce", 300 << 10, faster_direct)  # class 0: (256 KiB, 512 KiB)
            _call(t, "all_reduce", 5 << 20, slower_direct)  # class of [4 MiB, 8 MiB)
            _call(t, "all_gather", 5 << 20, faster_direct)
    want = {
        "all_reduce": {MIN + 1: "direct", 4 << 20: "slots"},
        "all_gather": {4 << 20: "direct"},
    }
    assert t0.decisions() == t1.decisions() == want
    assert t0.size_class(MIN + 1) == t0.size_class((512 << 10) - 1) == 0
    assert t0.size_class(512 << 10) == 1 and t0.size_class(1 << 60) == 30


def test_the_choice_is_reported_once_published_before_the_call_that_takes_it() -> None:
    _, (t0, t1) = _tuners(2)
    for _ in range(CALLS):
        for t in (t0, t1):
            _call(t, "reduce_scatter", 3 << 20, {False: 2.0, True: 1.0})
    assert t0.decisions() == t1.decisions() == {"reduce_scatter": {2 << 20: "direct"}}
    assert t1.pick("reduce_scatter", 3 << 20) == (True, None)


def test_a_rank_that_finds_no_published_choice_says_the_calls_diverged() -> None:
    _, (_, t1) = _tuners(2)  # rank 0 never calls: nothing is published
    for _ in range(CALLS):  # the trials, then the one call on the static rule
        _call(t1, "broadcast", 1 << 20, {False: 1.0, True: 1.0})
    with pytest.raises(RuntimeError, match="rank 0 has not published the path of size class 2"):
        t1.pick("broadcast", 1 << 20)


def test_a_call_that_raised_counts_nothing() -> None:
    _, (t0, _) = _tuners(2)
    assert t0.pick("all_reduce", 1 << 20)[0] is False  # trial 0 (slots), then the call raised: no done()
    assert t0.pick("all_reduce", 1 << 20)[0] is False  # still trial 0, not trial 1 (direct)
    _call(t0, "all_reduce", 1 << 20, {False: 1.0, True: 1.0})
    assert t0.pick("all_reduce", 1 << 20)[0] is True  # trial 1


def test_untimed_calls_are_counted_and_rank0_then_publishes_the_slots() -> None:
    """Tensors off the CPU: the calls count, nothing is timed, and the slots are chosen; nobody is left
    waiting for a choice that is never published."""
    _, (t0, t1) = _tuners(2)
    for _ in range(CALLS + 2):
        for t in (t0, t1):
            _call(t, "all_gather", 1 << 20, None)
    assert t0.decisions() == t1.decisions() == {"all_gather": {1 << 20: "slots"}}


def test_path_names_the_collectives_it_knows() -> None:
    _, (t0, _) = _tuners(2)
    assert t0.path("all_reduce", 4096) == "slots" and t0.path("all_reduce", 1 << 20) is None
    with pytest.raises(ValueError, match="'allreduce' is not one of the tuned collectives"):
        t0.path("allreduce", 1 << 20)
