"""Running the same command again: a no-op resume keeps the run's checkpoint in its summary; a rejected
``--ckpt-dir`` leaves no empty run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_a_no_op_resume_keeps_the_checkpoint(tmp_path: Path) -> None:
    args = ["train", "--strategy", "single", "--model", "mlp", "--set", "model.hidden=8", "--steps", "2",
            "--run-dir", "r", "--json"]  # fmt: skip
    first = last_json(run_cli(*args, cwd=tmp_path, timeout=140).stdout)
    again = run_cli(*args, cwd=tmp_path, timeout=140)
    assert "nothing to train" in again.stderr
    second = last_json(again.stdout)
    assert first["checkpoint"] and second["checkpoint"] == first["checkpoint"]
    assert second["param_sha256"] == first["param_sha256"]


@pytest.mark.timeout(120)
def test_a_rejected_ckpt_dir_leaves_no_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """From paratrain.cli.main in this process: the same parser, checks and message as the command, without
    an interpreter and torch start."""
    from paratrain.cli import main

    (tmp_path / "afile").write_text("x")
    monkeypatch.chdir(tmp_path)
    rc = main(["train", "--strategy", "single", "--model", "mlp", "--steps", "1", "--run-dir", "r",
               "--ckpt-dir", "afile/ckpts"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "afile" in err
    assert not (tmp_path / "r").exists()
