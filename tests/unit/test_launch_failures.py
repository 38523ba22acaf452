"""The launcher's one-paragraph report of a failed worker group (paratrain.launch.failures): root cause first."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from paratrain.launch.failures import format_failure, read_failures

SHM_DEAD = (
    "RuntimeError: shm all_reduce_inplace_slot #474: rank 1 (pid 8741) died while the others waited for its "
    "input; the collective cannot complete"
)
DDP_SHM_DEAD = (  # the same, raised inside torch DDP's comm-hook future
    "RuntimeError: Unable to cast shm all_reduce #548: rank 1 (pid 9027) died while the others waited for its "
    "input; the collective cannot complete to Tensor"
)


def _err(**ranks: tuple[int, str]) -> SimpleNamespace:
    """An elastic ``ChildFailedError`` stand-in: ``rank -> (exitcode, recorded message or "")``."""
    failures = {}
    for key, (code, message) in ranks.items():
        data = {"message": {"message": message, "extraInfo": {"py_callstack": "Traceback ...\n" if message
                                                               else "", "raised_at": 100.0}}}  # fmt: skip
        failures[int(key[1:])] = SimpleNamespace(error_file_data=data if message else {}, exitcode=code,
                                                 local_rank=int(key[1:]), timestamp=99)  # fmt: skip
    return SimpleNamespace(failures=failures)


@pytest.mark.parametrize("message", [SHM_DEAD, DDP_SHM_DEAD])
def test_a_killed_rank_under_shm_is_the_headline_not_the_rank_that_noticed(message: str) -> None:
    got = format_failure(read_failures(_err(r0=(1, message), r1=(-signal.SIGKILL, ""))), 0)
    assert got.splitlines()[0] == "rank 1 died (killed by signal SIGKILL)", got
    assert got.splitlines()[1] == f"  rank 0 then failed: {message}", got
    assert "stopped after it" not in got


def test_a_rank_that_raised_first_stays_the_headline() -> None:
    got = format_failure(read_failures(_err(r0=(1, "ValueError: rank 0 broke"), r1=(-signal.SIGTERM, ""))), 0)
    assert got.splitlines()[0] == "rank 0 failed (exit code 1): ValueError: rank 0 broke", got
    assert got.splitlines()[-1] == "  ranks [1] stopped after it."
