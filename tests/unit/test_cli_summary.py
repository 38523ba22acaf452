"""The human summary `paratrain train` prints without --json: the memory rows appear when measured."""

from __future__ import annotations

import pytest

from paratrain.cli import _print_summary

BASE = {"strategy": "ddp", "world_size": 2, "device": "cuda", "backend": "nccl", "num_params": 1000, "steps": 4,
        "final_loss": 1.5, "eval_accuracy": None, "eval_loss": None, "samples_per_s": 10.0,
        "model_state_bytes_per_rank": 16 * 2**20, "checkpoint": None, "param_sha256": "ab" * 32}  # fmt: skip


def test_gpu_rows_only_with_allocator_figures(capsys: pytest.CaptureFixture[str]) -> None:
    _print_summary({**BASE, "peak_bytes_per_rank": 24 * 2**20, "cuda_peak_allocated_bytes_per_rank": None})
    cpu = capsys.readouterr().out
    assert "peak / rank  24.00 MiB (during a step)" in cpu and "GPU peak" not in cpu
    _print_summary({**BASE, "peak_bytes_per_rank": 24 * 2**20, "cuda_peak_allocated_bytes_per_rank": 90 * 2**20,
                    "cuda_peak_reserved_bytes_per_rank": 96 * 2**20})  # fmt: skip
    gpu = capsys.readouterr().out
    assert "GPU peak / rank  90.00 MiB allocated, 96.00 MiB reserved" in gpu, gpu
