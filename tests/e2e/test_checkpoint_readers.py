"""Checkpoint readers other than training (``generate``, ``ckpt export``) verify a checkpoint before they
build anything from it, and say so when they use an older step than the newest."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_readers_verify_first_and_warn_when_they_fall_back(
    tmp_path: Path, cli_main: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    run = tmp_path / "lm"
    run_cli("train", "--model", "llama-debug", "--data", "python-stdlib", "--set", "data.max_bytes=50000",
            "--seq-len", "32", "--steps", "4", "--batch-size", "4", "--strategy", "single", "--nproc-per-node", "1",
            "--ckpt-every", "2", "--run-dir", str(run), cwd=tmp_path, timeout=240)  # fmt: skip
    ckpts = run / "checkpoints"
    # every checkpoint reader takes the run directory, checkpoints/, its latest file or one step
    from paratrain.checkpoint.export_hf import export_hf
    from paratrain.checkpoint.inspect import inspect_dir, resolve_checkpoint

    for where in (run, ckpts, ckpts / "latest", ckpts / "step_00000004"):
        assert resolve_checkpoint(where) == ckpts / "step_00000004"
        assert [c["step"] for c in inspect_dir(where, fast=True)["checkpoints"]][-1] == 4
    assert export_hf(ckpts / "latest", tmp_path / "hf")["tensors"] > 0
    # an edited train_state.json (same checkpoint otherwise): refused by its checksum before a model is
    # built from the config it holds (here: one that is not a language model)
    edited = tmp_path / "edited" / "step_00000002"
    shutil.copytree(ckpts / "step_00000002", edited)
    state = edited / "train_state.json"
    state.write_text(state.read_text().replace('"llama-debug"', '"mlp"'))
    proc = cli_main("generate", "--ckpt", str(edited), "--max-new-tokens", "2", cwd=tmp_path)  # in process
    assert proc.returncode == 2, proc.stderr
    assert "is not a usable checkpoint" in proc.stderr and "train_state.json" in proc.stderr, proc.stderr
    assert "not a language model" not in proc.stderr and "Traceback" not in proc.stderr
    # the newest step damaged (one byte of its data, same size): both readers use step 2, and say so
    data = ckpts / "step_00000004" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    warning = "warning: using step_00000002, an older step than the newest: passed over step_00000004"
    # generate as a user runs it (a subprocess); ckpt export from paratrain.cli.main in this process
    gen = run_cli("generate", "--ckpt", str(run), "--max-new-tokens", "2", "--json", cwd=tmp_path)
    assert json.loads(gen.stdout.splitlines()[-1])["step"] == 2
    assert warning in gen.stderr and "checksum" in gen.stderr, gen.stderr
    out = cli_main("ckpt", "export", str(run), str(tmp_path / "model.safetensors"), "--json", cwd=tmp_path)
    assert out.returncode == 0 and warning in out.stderr, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["tensors"] > 0
