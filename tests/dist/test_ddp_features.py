"""Training features on N Gloo ranks vs an independent single-process reference: SyncBatchNorm (module and
whole-run), activation checkpointing, gradient clipping, evaluation split across ranks, bf16.

More of each elsewhere: evaluation totals at 2, 3 and 4 ranks (test_eval_totals.py), bf16 for every strategy
(test_precision.py), that checkpointing recomputes (tests/unit/test_activation_checkpointing.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist._reference import (
    assert_matches,
    assert_matches_bf16,
    make_cfg,
    reference,
    single_process_eval,
    train_cases,
)


def _bn_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None),  # cumulative average variant too
    )  # fmt: skip


def _global_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(8, 3, 5, 5, generator=g) * 2 + 1, torch.randn(8, 4, 5, 5, generator=g)


def _sync_bn_rank() -> dict[str, Any]:
    from paratrain.parallel.layers import convert_sync_batchnorm

    r, w = dist.get_rank(), dist.get_world_size()
    net = convert_sync_batchnorm(_bn_net())
    x, g = _global_inputs()
    n = x.shape[0] // w
    xr = x[r * n : (r + 1) * n].clone().requires_grad_(True)
    out = None
    for _ in range(2):  # two steps: running statistics accumulate
        out = net(xr)
        (out * g[r * n : (r + 1) * n]).sum().backward()
    grads = {k: p.grad.clone() for k, p in net.named_parameters()}
    for t in grads.values():
        dist.all_reduce(t)  # the sum over ranks of each rank's contribution = the full-batch gradient
    return {"out": out.detach(), "xgrad": xr.grad, "grads": grads, "buffers": dict(net.named_buffers())}


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_sync_batchnorm_matches_batchnorm_on_full_batch(dist_run: Any, world_size: int) -> None:
    res = dist_run(_sync_bn_rank, world_size, timeout_s=50)
    ref = _bn_net()
    x, g = _global_inputs()
    x.requires_grad_(True)
    for _ in range(2):
        out = ref(x)
        (out * g).sum().backward()
    n = 8 // world_size
    for r, got in enumerate(res):
        sl = slice(r * n, (r + 1) * n)
        assert torch.allclose(got["out"], out[sl].detach(), atol=1e-5)
        assert torch.allclose(got["xgrad"], x.grad[sl], atol=1e-5)
        for k, p in ref.named_parameters():
            assert torch.allclose(got["grads"][k], p.grad, atol=1e-4), k
        for k, b in ref.named_buffers():
            assert torch.allclose(got["buffers"][k].float(), b.float(), atol=1e-5), k


DIGITS = ["data.name=digits", "train.steps=3", "train.batch_size=16", "optimizer.name=sgd", "optimizer.lr=0.05"]
CNN_BN = [*DIGITS, "model.name=cnn", "model.channels=4", "model.batchnorm=true"]
CASES: dict[str, list[str]] = {
    # per-rank batch 8 < 16: SyncBatchNorm is chosen automatically
    "cnn-bn/ddp": [*CNN_BN, "strategy.name=ddp"],
    # ring: background-thread p2p on dp's own group while SyncBatchNorm
    # all-reduces on the main thread
    "cnn-bn/dp": [*CNN_BN, "strategy.name=dp", "strategy.comm_algorithm=ring"],
    # activation checkpointing of every residual block, with SyncBatchNorm and global-norm clipping
    "resnet/dp/ac/clip": [
        *DIGITS, "model.name=resnet18", "model.channels=4", "strategy.name=dp",
        "train.activation_checkpointing=true", "optimizer.grad_clip=0.05",
    ],
    "mlp/ddp/clip": [*DIGITS, "model.name=mlp", "model.hidden=16", "strategy.name=ddp", "optimizer.grad_clip=0.05"],
    # local BatchNorm: must differ from the full-batch reference (shows the test can see the difference)
    "cnn-bn/ddp/no-sync": [*CNN_BN, "strategy.name=ddp", "train.sync_batchnorm=false"],
    "mlp/ddp/bf16": [*DIGITS, "model.name=mlp", "model.hidden=16", "strategy.name=ddp", "train.precision=bf16"],
}


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_features_match_single_process(dist_run: Any, tmp_path: Path) -> None:
    results = dist_run(train_cases, 2, list(CASES.values()), str(tmp_path), timeout_s=220)
    got = dict(zip(CASES, results[0], strict=True))
    assert got["cnn-bn/dp"]["algorithm"] == "ring"  # the ring ran, not a fallback to native
    for name in ("cnn-bn/ddp", "cnn-bn/dp", "resnet/dp/ac/clip", "mlp/ddp/clip"):
        overrides = [o for o in CASES[name] if "activation_checkpointing" not in o]
        ref = reference(make_cfg(*overrides))  # plain BatchNorm on the full batch, no checkpointing
        assert_matches(got[name], ref, name)
        if name.startswith(("cnn-bn", "resnet")):  # running statistics: SyncBN's, updated once per step
            for k, b in ref["buffers"].items():
                assert torch.allclose(got[name]["buffers"][k].float(), b.float(), atol=1e-5), f"{name}: buffer {k}"
        # evaluation split across ranks (359 samples, padded to 2 x 180): one process's totals on the same state
        correct, loss = single_process_eval(make_cfg(*overrides), got[name]["params"], got[name]["buffers"])
        assert len(correct) == 359
        assert abs(got[name]["eval_accuracy"] - float(correct.mean())) <= 1e-6, name
        assert abs(got[name]["eval_loss"] - float(loss.mean())) <= 1e-6, name
    unclipped = reference(make_cfg(*[o for o in CASES["mlp/ddp/clip"] if "grad_clip" not in o]))
    assert abs(unclipped["losses"][-1] - got["mlp/ddp/clip"]["losses"][-1]) > 1e-4  # clipping was active
    local_bn = got["cnn-bn/ddp/no-sync"]
    ref = reference(make_cfg(*CASES["cnn-bn/ddp"]))
    assert abs(local_bn["losses"][1] - ref["losses"][1]) > 1e-4  # per-rank statistics differ from the batch's
    # bf16 autocast against the one-process bf16 reference, within a tolerance derived from bf16's roundoff
    assert_matches_bf16(got["mlp/ddp/bf16"], reference(make_cfg(*CASES["mlp/ddp/bf16"])), "mlp/ddp/bf16")


def _cuda_cases(run_root: str) -> list[dict[str, Any]]:
    return train_cases([CASES["cnn-bn/ddp"], CASES["cnn-bn/dp"], CASES["mlp/ddp/bf16"]], run_root)


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL ddp/dp with torch's SyncBatchNorm)")
def test_cuda_nccl_matches_single_process(tmp_path: Path) -> None:
    """The same equivalence on NCCL: DDP with device_ids, dp's async NCCL buckets, torch's SyncBatchNorm kernel."""
    from paratrain.testing import run_distributed

    res = run_distributed(_cuda_cases, 2, args=(str(tmp_path),), backend="nccl", timeout_s=280)[0]
    for name, got in zip(["cnn-bn/ddp", "cnn-bn/dp"], res[:2], strict=True):
        # the CPU reference: GPU kernels sum in another order (TF32 is off by default for float32 matmuls)
        assert_matches(got, reference(make_cfg(*CASES[name])), f"{name} on cuda", atol=1e-4, rtol=1e-3)
    # bf16 autocast on CUDA against the CPU bf16 reference, within the tolerance derived from bf16's roundoff
    assert_matches_bf16(res[2], reference(make_cfg(*CASES["mlp/ddp/bf16"])), "mlp/ddp/bf16 on cuda")
