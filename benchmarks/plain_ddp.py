"""A plain, hand-written torch DDP training loop: the baseline paratrain's ``ddp`` and ``dp`` are timed against.

Nothing from paratrain: ``init_process_group`` from the torchrun environment, the model moved to its device,
``DistributedDataParallel`` with its defaults, and the textbook loop (zero_grad, forward, loss, backward,
step) over an in-memory tensor dataset. Run it on its own:

    torchrun --nproc-per-node 2 benchmarks/plain_ddp.py --steps 20

or import :func:`build` / :func:`step` (what ``benchmarks/bench_ddp.py`` does, to time it side by side with
paratrain in the same processes).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def build(
    model: nn.Module, device: torch.device, lr: float = 0.01
) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip
    model, opt = build(model, device)
    x = torch.randn(args.batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    for _ in range(3):
        step(model, opt, x, y)
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step(model, opt, x, y)
    if cuda:
        torch.cuda.synchronize(device)
    dt = (time.perf_counter() - t0) / args.steps
    if dist.get_rank() == 0:
        print(f"plain DDP: {dt * 1e3:.1f} ms/step, loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
