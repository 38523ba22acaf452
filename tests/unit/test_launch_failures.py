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


def test_the_frame_named_is_the_user_s_code_that_called_into_a_library() -> None:
    """A shape mismatch raises in torch's linear.py; the report names the user's line that called it."""
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/src/paratrain/train/trainer.py", line 300, in _step\n'
        '  File "/home/me/mypkg/models.py", line 20, in forward\n'
        '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1780, in _call_impl\n'
        '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 134, in forward\n'
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (256x8 and 1x32)\n"
    )
    err = _err(r0=(1, "RuntimeError: mat1 and mat2 shapes cannot be multiplied (256x8 and 1x32)"))
    err.failures[0].error_file_data["message"]["extraInfo"]["py_callstack"] = tb
    got = format_failure(read_failures(err), 0).splitlines()
    assert got[1] == (
        '  at File "/home/me/mypkg/models.py", line 20, in forward (raised in torch/nn/modules/linear.py:134)'
    ), got
    only_lib = tb.replace("/home/me/mypkg", "/venv/lib/python3.11/site-packages/lib").replace(
        "/src/", "/venv/lib/python3.11/"
    )
    err.failures[0].error_file_data["message"]["extraInfo"]["py_callstack"] = only_lib
    assert format_failure(read_failures(err), 0).splitlines()[1].endswith('linear.py", line 134, in forward')
