"""MoE checkpoints as a user resumes them: experts are saved under their original names with their global
index (DCP reshards them), so a run saved under ``ep`` on 2 ranks continues under ``ep`` on 4 and then under
``single`` on the single-process loss curve; a resume at the same layout is bit-exact; a checkpoint with
another number of experts is refused before launch, naming both counts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli

pytestmark = pytest.mark.e2e

MOE = [
    "--model", "llama-moe-debug", "--data", "python-stdlib", "--set", "data.max_bytes=60000", "--seq-len", "32",
    "--set", "model.n_layers=2", "--batch-size", "8", "--lr", "0.003", "--set", "model.aux_loss_coef=0.01",
    "--set", "model.bias_update_rate=0.01", "--set", "train.eval_every=0", "--json",
]  # fmt: skip


def _train(tmp_path: Path, steps: int, strategy: str, ranks: int, ckpt: Path | None, *extra: str) -> dict:
    args = [
        "train",
        *MOE,
        "--steps",
        str(steps),
        "--strategy",
        strategy,
        "--nproc-per-node",
        str(ranks),
        *extra,
    ]
    if ckpt is not None:
        args += ["--ckpt-dir", str(ckpt), "--set", "checkpoint.save_at_end=true"]
    else:
        args += ["--set", "checkpoint.save_at_end=false"]
    return last_json(run_cli(*args, cwd=tmp_path, timeout=240).stdout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ep2_to_ep4_to_single_continues_the_single_curve(tmp_path: Path) -> None:
    ref = _train(tmp_path, 6, "single", 1, None)
    ckpt = tmp_path / "ckpt"
    a = _train(tmp_path, 2, "ep", 2, ckpt)
    b = _train(tmp_path, 4, "ep", 4, ckpt)
    c = _train(tmp_path, 6, "single", 1, ckpt)
    assert (a["resumed_from_step"], b["resumed_from_step"], c["resumed_from_step"]) == (None, 2, 4)
    assert a["losses"] + b["losses"][2:] + c["losses"][4:] == pytest.approx(ref["losses"], rel=1e-4)
    assert c["param_norm"] == pytest.approx(ref["param_norm"], rel=1e-5)


@pytest.mark.timeout(600)
def test_same_layout_resume_is_bit_exact_and_wrong_expert_count_refused(tmp_path: Path) -> None:
    # The uninterrupted run also saves step 2; the resume starts from a copy that holds only that step
    # (one launch fewer than training 2 steps apart).
    whole = _train(tmp_path, 4, "ep", 2, tmp_path / "whole", "--ckpt-every", "2")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tmp_path / "whole", ckpt)
    shutil.rmtree(ckpt / "step_00000004")
    assert (ckpt / "latest").read_text().strip() == "step_00000004"
    (ckpt / "latest").write_text("step_00000002\n")
    resumed = _train(tmp_path, 4, "ep", 2, ckpt)
    assert resumed["resumed_from_step"] == 2
    assert resumed["param_sha256"] == whole["param_sha256"]
    proc = run_cli("train", *MOE, "--steps", "6", "--strategy", "single", "--ckpt-dir", str(ckpt),
                   "--set", "model.n_experts=4", cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "the checkpoint has 8 experts per MoE layer, the model 4 (model.n_experts)" in proc.stderr, (
        proc.stderr
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp_tp_ep_checkpoint_continues_under_single(tmp_path: Path) -> None:
    """A run saved under fsdp+tp+ep (dp_shard 2 x tp 2, ep 2: experts as 2-D DTensors over (edp, ep)) resumes
    under single on the single-process curve. No auxiliary loss: fsdp+tp+ep routes sequence slices."""
    no_aux = ("--set", "model.aux_loss_coef=0")
    ref = _train(tmp_path, 4, "single", 1, None, *no_aux)
    ckpt = tmp_path / "ckpt"
    a = _train(tmp_path, 2, "fsdp+tp+ep", 4, ckpt, "--tp", "2", "--ep", "2", *no_aux)
    b = _train(tmp_path, 4, "single", 1, ckpt, *no_aux)
    assert a["topology"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2, "ep": 2}
    assert b["resumed_from_step"] == 2
    assert a["losses"] + b["losses"][2:] == pytest.approx(ref["losses"], rel=1e-4)
    assert b["param_norm"] == pytest.approx(ref["param_norm"], rel=1e-5)
    # the expert counts of the last step, summed over dp x tp: every routed assignment once
    assert sum(a["moe"]["tokens_per_expert"][0]) == 8 * 32 * 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp_ep_pp_checkpoint_continues_under_single(tmp_path: Path) -> None:
    """A run saved under fsdp+ep+pp (2 stages, each dp_shard 2 with ep 2: a stage holds its own layer's experts)
    resumes under single on the single-process curve: the stages' checkpoints together hold every expert under
    its global index. No auxiliary loss: only the last stage computes the loss."""
    no_aux = ("--set", "model.aux_loss_coef=0")
    ref = _train(tmp_path, 4, "single", 1, None, *no_aux)
    ckpt = tmp_path / "ckpt"
    a = _train(tmp_path, 2, "fsdp+ep+pp", 4, ckpt, "--pp", "2", "--ep", "2", *no_aux)
    b = _train(tmp_path, 4, "single", 1, ckpt, *no_aux)
    assert a["topology"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 2}
    assert b["resumed_from_step"] == 2
    assert a["losses"] + b["losses"][2:] == pytest.approx(ref["losses"], rel=1e-4)
    assert b["param_norm"] == pytest.approx(ref["param_norm"], rel=1e-5)
    # the summary's expert load covers every MoE block of both stages, in layer order: each block routed the
    # step's tokens x top_k (dropless), as the single-process run's blocks did
    tables, ref_tables = a["moe"]["tokens_per_expert"], ref["moe"]["tokens_per_expert"]
    assert len(tables) == len(ref_tables) > 1
    assert [sum(t) for t in tables] == [sum(t) for t in ref_tables]
