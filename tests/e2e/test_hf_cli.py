"""``paratrain train --model hf:DIR`` as a user runs it: refusals before launch, training with the model's
own tokenizer, and an interrupted zero3 run resumed to the same parameters as an uninterrupted one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import last_json, run_cli

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory: Any) -> Path:
    from tests._hf_models import TEXT, make_hf_dir

    root = tmp_path_factory.mktemp("hfcli")
    make_hf_dir(root / "llama", "llama")
    make_hf_dir(root / "opt", "opt")
    (root / "corpus.txt").write_text(TEXT * 20)
    return root


def _train(root: Path, model: str, *extra: str, check: bool = True) -> Any:
    return run_cli(
        "train", "--model", f"hf:{root / model}", "--data", f"text:{root / 'corpus.txt'}", "--seq-len", "16",
        "--batch-size", "4", "--lr", "0.01", "--json", *extra, cwd=root, timeout=240, check=check,
    )  # fmt: skip


def _refused(root: Path, model: str, *extra: str, capsys: Any, monkeypatch: Any) -> str:
    """``paratrain train`` refusing before launch, run by ``paratrain.cli.main`` in this process (the command
    line, checks and message are the CLI's; only the interpreter start is shared): its stderr."""
    from paratrain.cli import main

    monkeypatch.chdir(root)
    capsys.readouterr()
    args = ["train", "--model", f"hf:{root / model}", "--data", f"text:{root / 'corpus.txt'}", "--seq-len", "16",
            "--batch-size", "4", "--steps", "1", *extra]  # fmt: skip
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") <= 3, "one clear message, not a traceback"
    return err


@pytest.mark.timeout(300)
def test_bad_directories_are_refused_before_launch(hf_root: Path, capsys: Any, monkeypatch: Any) -> None:
    empty = hf_root / "empty"
    empty.mkdir(exist_ok=True)
    err = _refused(hf_root, "empty", capsys=capsys, monkeypatch=monkeypatch)
    assert "has no config.json" in err and "logs" not in err

    broken = hf_root / "broken"
    if not broken.exists():
        shutil.copytree(hf_root / "llama", broken)
        next(iter(sorted(broken.glob("model-*.safetensors")))).unlink()
    err = _refused(hf_root, "broken", capsys=capsys, monkeypatch=monkeypatch)
    assert "model.safetensors.index.json names 1 weight file(s) that are not in the directory" in err
    assert not (hf_root / "runs").exists(), "nothing may start (or be written) for a bad input"


@pytest.mark.timeout(300)
def test_model_parallel_refusals_name_the_model(hf_root: Path, capsys: Any, monkeypatch: Any) -> None:
    err = _refused(
        hf_root, "opt", "--strategy", "tp", "--nproc-per-node", "2", capsys=capsys, monkeypatch=monkeypatch
    )
    assert "tensor parallelism (strategy tp" in err and "OPTForCausalLM" in err
    err = _refused(
        hf_root, "opt", "--strategy", "pp", "--nproc-per-node", "2", capsys=capsys, monkeypatch=monkeypatch
    )
    assert "pipeline parallelism (strategy pp" in err and "OPTForCausalLM" in err
    # 4 query heads, 2 key/value heads: --tp 4 cannot give each rank whole heads
    err = _refused(
        hf_root, "llama", "--strategy", "tp", "--nproc-per-node", "4", capsys=capsys, monkeypatch=monkeypatch
    )
    assert "tensor parallel degree 4 does not divide the heads of LlamaForCausalLM" in err
    assert "num_key_value_heads=2" in err
    # expert parallelism splits paratrain's own MoE layers, not a transformers model's (an MoE one included)
    for strategy in ("ep", "fsdp+ep"):
        err = _refused(hf_root, "opt", "--strategy", strategy, "--nproc-per-node", "2", capsys=capsys,
                       monkeypatch=monkeypatch)  # fmt: skip
        assert "expert parallelism (--ep 2)" in err and "OPTForCausalLM" in err and "ddp, zero1/2/3" in err
    assert not (hf_root / "runs").exists(), "nothing may start (or be written) for a bad input"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_run_resumes_to_the_uninterrupted_parameters(hf_root: Path) -> None:
    """3 steps then 2 more (restarted from the step-3 checkpoint) end at the sha of 5 uninterrupted steps;
    the model's own tokenizer (BOS/EOS, vocabulary 96) is used; the checkpoint keeps Hugging Face names."""
    z = ["--strategy", "zero3", "--nproc-per-node", "2"]
    full = last_json(_train(hf_root, "llama", *z, "--steps", "5", "--run-dir", "full").stdout)
    first = last_json(_train(hf_root, "llama", *z, "--steps", "3", "--run-dir", "part").stdout)
    resumed = last_json(_train(hf_root, "llama", *z, "--steps", "5", "--run-dir", "part").stdout)
    assert first["steps"] == 3 and resumed["resumed_from_step"] == 3
    assert resumed["param_sha256"] == full["param_sha256"]
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-5)
    assert full["num_params"] == 24736 and full["eval_perplexity"] is not None and "mfu" in full
    cfg = json.loads((hf_root / "full" / "config.json").read_text())
    assert cfg["data"]["tokenizer"] == f"hf:{hf_root / 'llama'}"
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(hf_root / "full" / "checkpoints" / "step_00000005")).read_metadata()
    assert "model.model.layers.1.self_attn.q_proj.weight" in md.state_dict_metadata
