"""``paratrain generate`` on a checkpoint a real ``paratrain train`` run wrote (sharded, 2 ranks).

The default tier runs one short sharded training and samples from it; ``slow`` adds the longer run with every
refusal (no checkpoint, not a language model, a broken step, a NaN temperature) and a wide vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e]


@pytest.mark.timeout(240)
def test_generate_from_a_two_rank_zero3_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "lm"
    run_cli("train", "--model", "llama-debug", "--data", "python-stdlib", "--set", "data.max_bytes=50000",
            "--seq-len", "32", "--steps", "2", "--batch-size", "4", "--strategy", "zero3", "--nproc-per-node", "2",
            "--run-dir", str(run), cwd=tmp_path, timeout=200)  # fmt: skip
    args = ["generate", "--ckpt", str(run), "--prompt", "def ", "--max-new-tokens", "8", "--json"]
    a = json.loads(run_cli(*args, cwd=tmp_path).stdout.strip().splitlines()[-1])
    # the second sample from paratrain.cli.main in this process (no second interpreter and torch start)
    from paratrain.cli import main

    capsys.readouterr()
    assert main(args) == 0
    b = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert a["checkpoint"].endswith("step_00000002") and a["step"] == 2 and a["model"] == "llama-debug"
    assert a["new_tokens"] == 8 and a["text"] == b["text"]  # same seed, same sample


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generate_samples_from_a_sharded_checkpoint_deterministically(tmp_path: Path) -> None:
    run = tmp_path / "lm"
    run_cli("train", "--model", "llama-debug", "--data", "python-stdlib", "--set", "data.max_bytes=200000",
            "--seq-len", "32", "--steps", "4", "--batch-size", "8", "--strategy", "zero3",
            "--run-dir", str(run), cwd=tmp_path, timeout=240)  # fmt: skip
    args = ["generate", "--ckpt", str(run), "--prompt", "def ", "--max-new-tokens", "12", "--json"]
    a = json.loads(run_cli(*args, cwd=tmp_path).stdout.strip().splitlines()[-1])
    b = json.loads(run_cli(*args, cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert a["checkpoint"].endswith("step_00000004") and a["step"] == 4 and a["model"] == "llama-debug"
    assert a["text"] == b["text"]  # same seed, same sample
    assert (
        len(a["text"].encode("utf-8", "replace")) >= 1
    )  # byte tokenizer: 12 tokens of (possibly multi-byte) text
    greedy = json.loads(
        run_cli(*args[:-1], "--temperature", "0", "--json", cwd=tmp_path).stdout.splitlines()[-1]
    )
    other = json.loads(run_cli(*args[:-1], "--seed", "7", "--json", cwd=tmp_path).stdout.splitlines()[-1])
    assert greedy["new_tokens"] == 12 and (other["text"] != a["text"] or greedy["text"] == a["text"])
    bad = run_cli("generate", "--ckpt", str(tmp_path / "nope"), cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    image = tmp_path / "cnn"
    run_cli("train", "--model", "mlp", "--steps", "2", "--strategy", "single", "--run-dir", str(image),
            cwd=tmp_path, timeout=120)  # fmt: skip
    not_lm = run_cli("generate", "--ckpt", str(image), cwd=tmp_path, check=False)
    assert not_lm.returncode == 2 and "not a language model" in not_lm.stderr
    nan = run_cli(*args[:-1], "--temperature", "nan", cwd=tmp_path, check=False)
    assert nan.returncode == 2 and "a finite number" in nan.stderr and "Traceback" not in nan.stderr
    import shutil

    broken = tmp_path / "broken" / "step_00000004"
    shutil.copytree(run / "checkpoints" / "step_00000004", broken)
    (broken / "train_state.json").unlink()
    gone = run_cli("generate", "--ckpt", str(broken), cwd=tmp_path, check=False)
    assert gone.returncode == 2 and "train_state.json" in gone.stderr and "Traceback" not in gone.stderr
    # a model with more output rows than the byte tokenizer has ids: only decodable ids are sampled
    wide = tmp_path / "wide"
    run_cli("train", "--model", "llama-debug", "--data", "python-stdlib", "--set", "data.max_bytes=50000",
            "--set", "model.vocab_size=300", "--seq-len", "32", "--steps", "2", "--batch-size", "4",
            "--strategy", "single", "--run-dir", str(wide), cwd=tmp_path, timeout=200)  # fmt: skip
    for t in ("1.5", "0"):
        got = run_cli("generate", "--ckpt", str(wide), "--max-new-tokens", "40", "--temperature", t, "--json",
                      cwd=tmp_path)  # fmt: skip
        assert json.loads(got.stdout.splitlines()[-1])["new_tokens"] == 40


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_generate_refuses_an_image_model_by_what_the_checkpoint_holds(tmp_path: Path) -> None:
    run_cli("train", "--model", "cnn", "--steps", "2", "--strategy", "single", "--nproc-per-node", "1",
            "--run-dir", "cnn", cwd=tmp_path, timeout=120)  # fmt: skip
    proc = run_cli("generate", "--ckpt", "cnn", "--prompt", "def ", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "holds a 'cnn' model, not a language model" in proc.stderr
    assert "--model" not in proc.stderr  # generate has no --model option to follow advice about
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
