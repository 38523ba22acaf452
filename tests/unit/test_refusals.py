"""Bad inputs get one message and exit 2 before any work, and with ``--json`` the refusal is JSON too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from paratrain.cli import main


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own refusals
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert "Traceback" not in err
    return out, err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["generate", "--ckpt", ".", "--temperature", "1e-45"], "--temperature 1e-45 is too small"),
        (
            ["generate", "--ckpt", ".", "--seed", "100000000000000000000000"],
            "--seed must be an integer",
        ),
        (["generate", "--ckpt", ".", "--seed", "-1"], "--seed must be an integer"),
        (["generate", "--ckpt", ".", "--seed", "1e23"], "--seed: expected an integer, got '1e23'"),
        (["plan", "--model", "llama-debug", "--gpu-mem", "1e400GB"], "'1e400GB' is not a finite number"),
        (["plan", "--model", "llama-debug", "--intra-bw", "1e400GB/s"], "not a finite number"),
        (["launch", "--hang-timeout", "5", "script.py"], "--hang-timeout only act(s) with --guard"),
        (
            ["launch", "--check-desync-every", "2", "script.py"],
            "--check-desync-every only act(s) with --guard",
        ),
    ],
)
def test_bad_values_are_refused_with_one_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    _out, err = _refused(capsys, *argv)
    assert words in err, err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1, err


def test_plan_calibrate_refuses_a_binary_file_and_a_fifo(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    binary = tmp_path / "bin"
    binary.write_bytes(bytes(range(256)) * 4)
    _out, err = _refused(capsys, "plan", "--model", "llama-debug", "--calibrate", str(binary))
    assert "cannot read it as JSON" in err, err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"results": [{"collective": "all_reduce", "algorithm": "native"}]}))
    _out, err = _refused(capsys, "plan", "--model", "llama-debug", "--calibrate", str(other))
    assert "not the JSON of `paratrain bench comm --json`" in err, err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _out, err = _refused(capsys, "plan", "--model", "llama-debug", "--calibrate", str(fifo))  # must not block
    assert "not a regular file" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--model", "llama-debug", "--gpu-mem", "1e400GB", "--json"],  # a refused value
        ["generate", "--ckpt", ".", "--temperature", "1e-45", "--json"],
        ["plan", "--model", "llama-debug", "--optimizer", "lion", "--json"],  # argparse's own refusal
    ],
)
def test_json_commands_refuse_in_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    out, err = _refused(capsys, *argv)
    refusal = json.loads(out.strip().splitlines()[-1])
    assert refusal["exit_code"] == 2 and "error:" in refusal["error"]
    assert refusal["error"].split("error: ", 1)[1] in err
