"""`paratrain train` on a CUDA GPU through NCCL (one process per GPU), as a user runs it: skipped without a GPU.

Each strategy that runs on one GPU (single, ddp, zero3) trains the digits MLP in fp32 and must end with the
losses of the same run on the CPU (Gloo) within float tolerance, and report the summary fields that need a
collective over the ranks (the model-state and peak bytes are reduced with a MAX over the ranks, which NCCL
only takes on the GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.cuda]

COMMON = ["--model", "mlp", "--data", "digits", "--steps", "12", "--precision", "fp32", "--json",
          "--nproc-per-node", "1", "--seed", "3"]  # fmt: skip


def _train(tmp_path: Path, strategy: str, device: str) -> dict:
    backend = "nccl" if device == "cuda" else "gloo"
    args = ["train", *COMMON, "--strategy", strategy, "--device", device, "--backend", backend]
    run_dir = tmp_path / f"{strategy}-{device}"
    run_dir.mkdir()
    return last_json(run_cli(*args, cwd=run_dir, timeout=240).stdout)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["single", "ddp", "zero3"])
def test_one_gpu_through_nccl_matches_the_cpu(tmp_path: Path, strategy: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gpu = _train(tmp_path, strategy, "cuda")
    cpu = _train(tmp_path, strategy, "cpu")
    assert gpu["steps"] == cpu["steps"] == 12
    assert gpu["losses"] == pytest.approx(cpu["losses"], rel=1e-3, abs=1e-4)
    assert gpu["model_state_bytes_per_rank"] == cpu["model_state_bytes_per_rank"] > 0
    assert gpu["param_norm"] == pytest.approx(cpu["param_norm"], rel=1e-3)
    # the allocator's own peak: at least the model states it holds at rest, and reserved covers allocated
    alloc, reserved = gpu["cuda_peak_allocated_bytes_per_rank"], gpu["cuda_peak_reserved_bytes_per_rank"]
    assert reserved >= alloc >= gpu["model_state_bytes_per_rank"], (alloc, reserved)
    assert (
        cpu["cuda_peak_allocated_bytes_per_rank"] is None and cpu["cuda_peak_reserved_bytes_per_rank"] is None
    )
