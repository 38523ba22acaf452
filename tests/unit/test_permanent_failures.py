"""Which failures a restart cannot fix (paratrain.errors.permanent_reason), and the launcher's record of one."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from paratrain.checkpoint.async_save import AsyncCheckpointError
from paratrain.checkpoint.errors import (
    CheckpointError,
    DamagedCheckpointError,
    save_error,
    save_failure_message,
)
from paratrain.errors import ConfigError, permanent_reason
from paratrain.launch.signals import no_restart_report
from paratrain.runtime import NO_RESTART_ENV, record_errors
from paratrain.train.faults import PeerLostError
from paratrain.train.nonfinite import NonFiniteError


def test_permanent_and_restartable_failures_are_told_apart(tmp_path: Path) -> None:
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    disk = save_error(save_failure_message(full, tmp_path, "step_00000010"))
    assert "full disk" in (permanent_reason(disk) or "")
    assert "full disk" in (permanent_reason(save_error(str(disk), AsyncCheckpointError)) or "")
    assert permanent_reason(NonFiniteError("nan at step 3"))
    assert permanent_reason(ConfigError("--lr must be > 0"))
    assert permanent_reason(DamagedCheckpointError("every checkpoint is damaged"))
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = NonFiniteError("nan")
    assert permanent_reason(wrapped)  # raised from a permanent one
    # what a restart can fix: a crashed or killed peer, an I/O error that is not a full disk
    assert permanent_reason(PeerLostError("rank 1 died")) is None
    assert (
        permanent_reason(save_error(save_failure_message(OSError(errno.EIO, "I/O"), tmp_path, "s"))) is None
    )
    assert permanent_reason(CheckpointError("checkpoint of another model")) is None


def test_a_worker_records_a_permanent_failure_once_for_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "no_restart.json"
    monkeypatch.setenv(NO_RESTART_ENV, str(path))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("RANK", "1")

    @record_errors
    def fails(exc: BaseException) -> None:
        raise exc

    with pytest.raises(SystemExit):
        fails(RuntimeError("connection reset by peer"))
    assert not path.exists()  # restartable: nothing recorded
    with pytest.raises(SystemExit):
        fails(NonFiniteError("non-finite loss at step 4"))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        fails(ConfigError("later, and another rank"))
    record = json.loads(path.read_text())
    assert record["rank"] == 1 and "non-finite loss at step 4" in record["message"]
    report = no_restart_report(str(path), 3)
    assert report is not None
    assert report.startswith("rank 1 failed: NonFiniteError: non-finite loss at step 4")
    assert "not restarted (--max-restarts 3 left unused): non-finite values" in report
    assert no_restart_report(str(tmp_path / "absent.json"), 3) is None
    assert os.stat(path).st_mode & 0o077 == 0
