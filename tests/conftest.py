"""Shared fixtures: the multi-process harness and helpers to run the CLI as a user does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from paratrain.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def dist_run() -> Callable[..., list[Any]]:
    """``dist_run(fn, world_size, *args, timeout_s=60)`` -> per-rank results (Gloo, forkserver)."""

    def run(
        fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0, **kwargs: Any
    ) -> list[Any]:
        return run_distributed(fn, world_size, args=args, kwargs=kwargs, timeout_s=timeout_s)

    return run


@pytest.fixture(autouse=True)
def _restore_env() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def cli_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(
    *args: str, cwd: Path | str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m paratrain ARGS`` as a user would; fail with its output when ``check`` and rc != 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "paratrain", *args],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"paratrain {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


@pytest.fixture
def cli_main(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``cli_main(*args, cwd=...)``: ``paratrain ARGS`` from ``paratrain.cli.main`` in the pytest process, for
    input that is refused before launch: the same parser, checks, messages and exit code as the command,
    without an interpreter and torch start (a few seconds each on a loaded 2-core machine). Returns a
    CompletedProcess like :func:`run_cli`'s."""

    def run(*args: str, cwd: Path | str) -> subprocess.CompletedProcess[str]:
        from paratrain.cli import main

        monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse's refusals
            rc = e.code if isinstance(e.code, int) else int(e.code is not None)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["paratrain", *args], rc, out.out, out.err)

    return run


def last_json(stdout: str) -> dict[str, Any]:
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])
