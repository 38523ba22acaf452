"""``paratrain lint``: every rule failing and passing, ignore comments, the CLI contract, the flake8 plugin,
and no findings on correct scripts (the repository's examples and realistic torchrun scripts below).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paratrain.lint import RULES, lint_paths, lint_source
from paratrain.lint.cli import add_arguments, run
from paratrain.lint.flake8 import ParatrainChecker

REPO = Path(__file__).resolve().parents[2]

# The contract: rule ids (in the order) and their flake8 codes.
RULE_IDS = [
    "data-parallel",
    "ddp-before-device",
    "no-distributed-sampler",
    "no-set-epoch",
    "batchnorm-not-synced",
    "loss-not-on-device",
    "hardcoded-device",
    "unseeded-init",
    "accumulation-without-no-sync",
    "find-unused-parameters",
    "rank-conditional-collective",
    "unsafe-torch-load",
    "save-on-every-rank",
    "no-destroy-process-group",
    "hardcoded-rendezvous",
    "unreduced-metric",
    "unseeded-split",
    "global-rank-as-device",
    "rank-independent-seed",
    "context-manager-not-entered",
    "local-rank-as-rank",
]
HYGIENE = {"unsafe-torch-load", "no-destroy-process-group"}

# A torchrun script's opening: process group, LOCAL_RANK device, same seed everywhere.
HEAD = """\
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("nccl")
rank = dist.get_rank()
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device(f"cuda:{local_rank}")
torch.cuda.set_device(device)
torch.manual_seed(0)
"""
HEAD_LINES = HEAD.count("\n")
TAIL = "dist.destroy_process_group()\n"


def script(body: str) -> str:
    """HEAD + body (dedented) + TAIL: line numbers in ``body`` start at HEAD_LINES + 1."""
    return HEAD + textwrap.dedent(body) + TAIL


def found(text: str) -> list[tuple[str, int]]:
    """Findings of every rule, the opt-in hygiene tier included (each rule is tested on its own)."""
    return [(f.rule, f.line) for f in lint_source(text, "train.py", select=["ALL"])]


# (rule, failing source, line of the finding, passing source: the same code, corrected)
CASES: list[tuple[str, str, int, str]] = [
    (
        "data-parallel",
        "import torch\nfrom torch import nn\n\nmodel = nn.Linear(10, 10)\nmodel = nn.DataParallel(model).cuda()\n",
        5,
        script("""\
            model = nn.Linear(10, 10).to(device)
            model = DDP(model, device_ids=[local_rank])
            """),
    ),
    (
        "ddp-before-device",
        script("""\
            model = nn.Linear(10, 10)
            model = DDP(model)
            model = model.to(device)
            """),
        HEAD_LINES + 2,
        script("""\
            model = nn.Linear(10, 10)
            model = model.to(device)
            model = DDP(model, device_ids=[local_rank])
            """),
    ),
    (
        "no-distributed-sampler",
        script("""\
            dataset = TensorDataset(torch.randn(64, 10), torch.randint(0, 2, (64,)))
            loader = DataLoader(dataset, batch_size=32, shuffle=True)
            """),
        HEAD_LINES + 2,
        script("""\
            dataset = TensorDataset(torch.randn(64, 10), torch.randint(0, 2, (64,)))
            loader = DataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset))
            """),
    ),
    (
        "no-set-epoch",
        script("""\
            dataset = TensorDataset(torch.randn(64, 10), torch.randint(0, 2, (64,)))
            sampler = DistributedSampler(dataset)
            loader = DataLoader(dataset, batch_size=32, sampler=sampler)
            for epoch in range(3):
                for x, y in loader:
                    pass
            """),
        HEAD_LINES + 2,
        script("""\
            dataset = TensorDataset(torch.randn(64, 10), torch.randint(0, 2, (64,)))
            sampler = DistributedSampler(dataset)
            loader = DataLoader(dataset, batch_size=32, sampler=sampler)
            for epoch in range(3):
                sampler.set_epoch(epoch)
                for x, y in loader:
                    pass
            """),
    ),
    (
        "batchnorm-not-synced",
        script("""\
            model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
            model = DDP(model.to(device), device_ids=[local_rank])
            """),
        HEAD_LINES + 1,
        script("""\
            model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            model = DDP(model.to(device), device_ids=[local_rank])
            """),
    ),
    (
        "loss-not-on-device",
        script("""\
            model = DDP(nn.Linear(10, 2).to(device), device_ids=[local_rank])
            criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0]))
            """),
        HEAD_LINES + 2,
        script("""\
            model = DDP(nn.Linear(10, 2).to(device), device_ids=[local_rank])
            criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0])).to(device)
            """),
    ),
    (
        "hardcoded-device",
        HEAD.replace('torch.device(f"cuda:{local_rank}")', 'torch.device("cuda:0")') + TAIL,
        12,
        HEAD + TAIL,
    ),
    (
        "unseeded-init",
        HEAD.replace("torch.manual_seed(0)\n", "")
        + textwrap.dedent("""\
            model = nn.Linear(10, 10).to(device)
            for p in model.parameters():
                p.register_hook(lambda g: dist.all_reduce(g) or g)
            """)
        + TAIL,
        HEAD_LINES,
        script("""\
            model = nn.Linear(10, 10).to(device)
            for p in model.parameters():
                p.register_hook(lambda g: dist.all_reduce(g) or g)
            """),
    ),
    (
        "accumulation-without-no-sync",
        script("""\
            model = DDP(nn.Linear(10, 1).to(device), device_ids=[local_rank])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(8):
                loss = model(torch.randn(4, 10, device=device)).sum() / 4
                loss.backward()
                if (i + 1) % 4 == 0:
                    optimizer.step()
                    optimizer.zero_grad()
            """),
        HEAD_LINES + 5,
        script("""\
            model = DDP(nn.Linear(10, 1).to(device), device_ids=[local_rank])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(8):
                if (i + 1) % 4 != 0:
                    with model.no_sync():
                        loss = model(torch.randn(4, 10, device=device)).sum() / 4
                        loss.backward()
                else:
                    loss = model(torch.randn(4, 10, device=device)).sum() / 4
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            """),
    ),
    (
        "find-unused-parameters",
        script("""\
            model = nn.Linear(10, 10).to(device)
            model = DDP(
                model,
                device_ids=[local_rank],
                find_unused_parameters=True,
            )
            """),
        HEAD_LINES + 5,
        script("""\
            model = nn.Linear(10, 10).to(device)
            model = DDP(
                model,
                device_ids=[local_rank],
                find_unused_parameters=False,
            )
            """),
    ),
    (
        "rank-conditional-collective",
        script("""\
            total = torch.ones(1, device=device)
            if rank == 0:
                dist.all_reduce(total)
                print(total.item())
            """),
        HEAD_LINES + 3,
        script("""\
            total = torch.ones(1, device=device)
            dist.all_reduce(total)
            if rank == 0:
                print(total.item())
            """),
    ),
    (
        "unsafe-torch-load",
        "import torch\n\nstate = torch.load('ckpt.pt', map_location='cpu')\n",
        3,
        "import torch\n\nstate = torch.load('ckpt.pt', map_location='cpu', weights_only=True)\n",
    ),
    (
        "save-on-every-rank",
        script("""\
            model = DDP(nn.Linear(10, 10).to(device), device_ids=[local_rank])
            torch.save(model.module.state_dict(), "model.pt")
            """),
        HEAD_LINES + 2,
        script("""\
            model = DDP(nn.Linear(10, 10).to(device), device_ids=[local_rank])
            if rank == 0:
                torch.save(model.module.state_dict(), "model.pt")
            dist.barrier()
            """),
    ),
    (
        "no-destroy-process-group",
        HEAD,
        9,
        HEAD + TAIL,
    ),
    (
        "hardcoded-rendezvous",
        'import os\n\nimport torch.distributed as dist\n\nos.environ["MASTER_PORT"] = "12355"\n'
        'dist.init_process_group("gloo")\ndist.destroy_process_group()\n',
        5,
        'import os\n\nimport torch.distributed as dist\n\nos.environ.setdefault("MASTER_PORT", "12355")\n'
        'dist.init_process_group("gloo")\ndist.destroy_process_group()\n',
    ),
    (
        "unreduced-metric",
        script("""\
            model = DDP(nn.Linear(10, 2).to(device), device_ids=[local_rank])
            sampler = DistributedSampler(TensorDataset(torch.randn(8, 10)), shuffle=False)
            correct = total = 0
            with torch.no_grad():
                for x, y in [(torch.randn(4, 10, device=device), torch.zeros(4, device=device))]:
                    correct += (model(x).argmax(1) == y).sum().item()
                    total += y.numel()
            if rank == 0:
                print(f"accuracy {correct / total:.2%}")
            """),
        HEAD_LINES + 9,
        script("""\
            model = DDP(nn.Linear(10, 2).to(device), device_ids=[local_rank])
            sampler = DistributedSampler(TensorDataset(torch.randn(8, 10)), shuffle=False)
            correct = total = 0
            with torch.no_grad():
                for x, y in [(torch.randn(4, 10, device=device), torch.zeros(4, device=device))]:
                    correct += (model(x).argmax(1) == y).sum().item()
                    total += y.numel()
            counts = torch.tensor([correct, total], device=device)
            dist.all_reduce(counts)
            correct, total = counts.tolist()
            if rank == 0:
                print(f"accuracy {correct / total:.2%}")
            """),
    ),
    (
        "unseeded-split",
        HEAD.replace("torch.manual_seed(0)\n", "")
        + "from torch.utils.data import random_split\n"
        + "train, test = random_split(TensorDataset(torch.randn(10, 2)), [8, 2])\n"
        + TAIL,
        HEAD_LINES + 1,
        HEAD.replace("torch.manual_seed(0)\n", "")
        + "from torch.utils.data import random_split\n"
        + "train, test = random_split(TensorDataset(torch.randn(10, 2)), [8, 2], "
        + "generator=torch.Generator().manual_seed(0))\n"
        + TAIL,
    ),
    (
        "global-rank-as-device",
        script("""\
            model = DDP(nn.Linear(4, 4).to(rank), device_ids=[rank])
            """),
        HEAD_LINES + 1,
        script("""\
            model = DDP(nn.Linear(4, 4).to(local_rank), device_ids=[local_rank])
            """),
    ),
    (
        "rank-independent-seed",
        script("""\
            import gymnasium as gym
            env = gym.make("CartPole-v1")
            obs, _ = env.reset(seed=0)
            """),
        HEAD_LINES + 3,
        script("""\
            import gymnasium as gym
            env = gym.make("CartPole-v1")
            obs, _ = env.reset(seed=rank)
            """),
    ),
    (
        "context-manager-not-entered",
        script("""\
            model = DDP(nn.Linear(4, 4).to(device), device_ids=[local_rank])
            model.no_sync()
            model(torch.randn(2, 4, device=device)).sum().backward()
            """),
        HEAD_LINES + 2,
        script("""\
            model = DDP(nn.Linear(4, 4).to(device), device_ids=[local_rank])
            with model.no_sync():
                model(torch.randn(2, 4, device=device)).sum().backward()
            """),
    ),
    (
        "local-rank-as-rank",
        'import os\n\nimport torch.distributed as dist\n\nlocal_rank = int(os.environ["LOCAL_RANK"])\n'
        'dist.init_process_group("nccl", rank=local_rank, world_size=16)\ndist.destroy_process_group()\n',
        6,
        'import os\n\nimport torch.distributed as dist\n\nlocal_rank = int(os.environ["LOCAL_RANK"])\n'
        'dist.init_process_group("nccl")\ndist.destroy_process_group()\n',
    ),
]


def test_rule_ids_are_the_contract() -> None:
    assert list(RULES) == RULE_IDS
    assert [r.code for r in RULES.values()] == [f"PTL{i:03d}" for i in range(1, 22)]
    assert {r.id for r in RULES.values() if r.tier == "hygiene"} == HYGIENE
    assert [c[0] for c in CASES] == RULE_IDS  # one failing and one passing case per rule
    for r in RULES.values():
        assert r.severity in ("error", "warning") and r.summary and r.fix
        assert r.check.__doc__ and "Fix" in r.check.__doc__  # each rule documents its pitfall and fix


@pytest.mark.parametrize(("rule", "bad", "line", "good"), CASES, ids=[c[0] for c in CASES])
def test_rule_fails_then_passes(rule: str, bad: str, line: int, good: str) -> None:
    assert found(bad) == [(rule, line)]
    assert found(good) == []


# -- more failing and passing variants: the expected findings are marked in the source with `# <- rule-id` --

VARIANTS: dict[str, str] = {
    "ddp: device_ids given does not move the model": script("""\
        model = nn.Linear(10, 10)
        model = DDP(model, device_ids=[local_rank])  # <- ddp-before-device
        """),
    "ddp: wrapping the moved model inline is fine": script("""\
        model = nn.Linear(10, 10)
        model = DDP(model.to(device), device_ids=[local_rank])
        """),
    "ddp: a model that comes in as an argument is not judged": script("""\
        def wrap(model: nn.Module) -> nn.Module:
            return DDP(model, device_ids=[local_rank])
        """),
    "ddp: a CPU (gloo) script that never places anything on a device": textwrap.dedent("""\
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 4))
        dist.destroy_process_group()
        """),
    "fsdp1 without device_id": script("""\
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = nn.Linear(10, 10)
        model = FSDP(model)  # <- ddp-before-device
        """),
    "fsdp1 with device_id": script("""\
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = nn.Linear(10, 10)
        model = FSDP(model, device_id=device)
        """),
    "fully_shard then an explicit move": script("""\
        from torch.distributed.fsdp import fully_shard
        model = nn.Linear(10, 10)
        fully_shard(model)  # <- ddp-before-device
        model.to(device)
        """),
    "unseeded: sharded by fully_shard is silent (one copy of each shard)": HEAD.replace(
        "torch.manual_seed(0)\n", ""
    )
    + textwrap.dedent("""\
        from torch.distributed.fsdp import fully_shard
        model = nn.Linear(10, 10).to(device)
        fully_shard(model)
        """)
    + TAIL,
    "unseeded: seeded in a helper of the file": HEAD.replace("torch.manual_seed(0)\n", "")
    + textwrap.dedent("""\
        def seed_all(seed: int) -> None:
            torch.manual_seed(seed)
        def main() -> None:
            seed_all(0)
            model = nn.Linear(10, 10).to(device)
            print(model)
        main()
        """)
    + TAIL,
    "unseeded: seeded in main() after the build (the call of main() is no seed before it)": HEAD.replace(
        "torch.manual_seed(0)\n", ""
    )
    + textwrap.dedent("""\
        def main() -> None:
            model = nn.Linear(10, 10).to(device)  # <- unseeded-init
            torch.manual_seed(0)
            print(model)
        main()
        """)
    + TAIL,
    "unseeded: a seed from the rank gives each rank its own weights": HEAD.replace(
        "torch.manual_seed(0)\n", "torch.manual_seed(42 + rank)\n"
    )
    + "model = nn.Linear(10, 10).to(device)  # <- unseeded-init\n"
    + TAIL,
    "unseeded: weights loaded after the build": HEAD.replace("torch.manual_seed(0)\n", "")
    + textwrap.dedent("""\
        model = nn.Linear(10, 10).to(device)
        model.load_state_dict(torch.load("model.pt", map_location=device, weights_only=True))
        """)
    + TAIL,
    "unseeded: random.seed does not seed torch": HEAD.replace(
        "torch.manual_seed(0)", "random.seed(0)"
    ).replace("import os", "import os\nimport random")
    + "model = nn.Linear(10, 10).to(device)  # <- unseeded-init\n"
    + TAIL,
    "unseeded: paratrain.init seeds by default": textwrap.dedent("""\
        import torch
        import paratrain
        ctx = paratrain.init()
        model = torch.nn.Linear(4, 4)
        model, optimizer, strategy = paratrain.setup(model, None, strategy="zero3", ctx=ctx)
        """),
    "unseeded: paratrain.init(seed=None) does not": textwrap.dedent("""\
        import torch
        import paratrain
        ctx = paratrain.init(seed=None)
        model = torch.nn.Linear(4, 4)  # <- unseeded-init
        """),
    "no sampler at all": script("""\
        dataset = TensorDataset(torch.randn(64, 10))
        loader = DataLoader(dataset, batch_size=32)  # <- no-distributed-sampler
        """),
    "an evaluation loader on rank 0 only, and explicit shuffle=False": script("""\
        dataset = TensorDataset(torch.randn(64, 10))
        everything = DataLoader(dataset, batch_size=32, shuffle=False)
        if rank == 0:
            test_loader = DataLoader(dataset, batch_size=32)
        """),
    "a DataLoader in a single-process script": textwrap.dedent("""\
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, shuffle=True)
        """),
    "set_epoch through loader.sampler, and an unshuffled validation sampler": script("""\
        dataset = TensorDataset(torch.randn(64, 10))
        loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset))
        val_loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset))
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            for (x,) in loader:
                pass
            for (x,) in val_loader:
                pass
        """),
    "no set_epoch, loader handed to a function each epoch": script("""\
        def train_one_epoch(loader):
            for batch in loader:
                pass
        dataset = TensorDataset(torch.randn(64, 10))
        sampler = DistributedSampler(dataset)  # <- no-set-epoch
        loader = DataLoader(dataset, batch_size=8, sampler=sampler)
        for epoch in range(2):
            train_one_epoch(loader)
        """),
    "one pass over the data needs no set_epoch": script("""\
        dataset = TensorDataset(torch.randn(64, 10))
        sampler = DistributedSampler(dataset)
        for (x,) in DataLoader(dataset, batch_size=8, sampler=sampler):
            pass
        """),
    "a stateless loss is fine anywhere": script("""\
        model = DDP(nn.Linear(10, 2).to(device), device_ids=[local_rank])
        criterion = nn.CrossEntropyLoss()
        """),
    "weighted loss moved later": script("""\
        weights = torch.tensor([1.0, 3.0])
        criterion = nn.CrossEntropyLoss(weight=weights)
        criterion.to(device)
        """),
    "weighted loss, weight built on the device": script("""\
        weights = torch.tensor([1.0, 3.0], device=device)
        criterion = nn.CrossEntropyLoss(weight=weights)
        pos = nn.BCEWithLogitsLoss(pos_weight=torch.ones(2))  # <- loss-not-on-device
        """),
    "hardcoded device forms": script("""\
        torch.cuda.set_device(0)  # <- hardcoded-device
        a = torch.ones(1).cuda(0)  # <- hardcoded-device
        b = torch.ones(1).to("cuda:1")  # <- hardcoded-device
        c = torch.device("cuda", 0)  # <- hardcoded-device
        d = torch.load("x.pt", map_location={"cuda:0": f"cuda:{local_rank}"}, weights_only=True)
        e = "cuda:0" if dist.get_world_size() == 1 else f"cuda:{local_rank}"
        """),
    "cuda:0 in a single-process script": 'import torch\ndevice = torch.device("cuda:0")\n',
    "cuda:0 with CUDA_VISIBLE_DEVICES set per process": script("""\
        os.environ["CUDA_VISIBLE_DEVICES"] = str(local_rank)
        x = torch.ones(1, device="cuda:0")
        """),
    "accumulation in an inner micro-step loop": script("""\
        model = DDP(nn.Linear(10, 1).to(device), device_ids=[local_rank])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            for micro in range(4):
                model(torch.randn(2, 10, device=device)).sum().backward()  # <- accumulation-without-no-sync
            optimizer.step()
        """),
    "accumulation with require_backward_grad_sync (nanoGPT)": script("""\
        model = DDP(nn.Linear(10, 1).to(device), device_ids=[local_rank])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            for micro in range(4):
                model.require_backward_grad_sync = micro == 3
                model(torch.randn(2, 10, device=device)).sum().backward()
            optimizer.step()
        """),
    "accumulation without DDP syncs nothing": textwrap.dedent("""\
        import torch
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(8):
            model(torch.randn(2, 4)).sum().backward()
            if (i + 1) % 4 == 0:
                optimizer.step()
        """),
    "collective in both branches, on a subgroup, and send/recv": script("""\
        t = torch.ones(1, device=device)
        group = dist.new_group([0, 1])
        if rank == 0:
            dist.broadcast(t, src=0)
            dist.send(t, dst=1)
        else:
            dist.broadcast(t, src=0)
            dist.recv(t, src=0)
        if rank in (0, 1):
            dist.all_reduce(t, group=group)
        if local_rank != -1:
            dist.barrier()
        """),
    "collective under elif without the same op in the else": script("""\
        t = torch.ones(1, device=device)
        if rank == 0:
            dist.all_reduce(t)
        elif rank == 1:
            dist.all_reduce(t)
        else:
            print("skip")
        """)
    .replace("    dist.all_reduce(t)\nelif", "    dist.all_reduce(t)  # <- rank-conditional-collective\nelif")
    .replace(
        "    dist.all_reduce(t)\nelse", "    dist.all_reduce(t)  # <- rank-conditional-collective\nelse"
    ),
    "a local function that issues a collective, called on rank 0": script("""\
        def evaluate(t):
            dist.all_reduce(t)
            return t
        if rank == 0:
            evaluate(torch.ones(1))  # <- rank-conditional-collective
        """),
    "an early exit before a barrier": script("""\
        def finish():
            if not dist.get_rank() == 0:
                return
            dist.barrier()  # <- rank-conditional-collective
        """),
    "rank 0 first: the paired barriers of 'download on rank 0'": script("""\
        if local_rank != 0:
            dist.barrier()
        dataset = TensorDataset(torch.randn(8, 2))
        if local_rank == 0:
            dist.barrier()
        """),
    "rank 0 first, written with `not` and `> 0`": script("""\
        if not is_main:
            dist.barrier()
        dataset = TensorDataset(torch.randn(8, 2))
        if is_main:
            dist.barrier()
        if rank > 0:
            dist.barrier()
        if rank == 0:
            dist.barrier()
        """),
    "two blocks under the same rank condition do not pair": script("""\
        t = torch.ones(1, device=device)
        if rank == 0:
            dist.all_reduce(t)  # <- rank-conditional-collective
            print(t)
        if rank == 0:
            dist.all_reduce(t)  # <- rank-conditional-collective
        """),
    "rank 0 and rank 1 blocks do not pair (rank 2 and up never call it)": script("""\
        t = torch.ones(1, device=device)
        if rank == 0:
            dist.all_reduce(t)  # <- rank-conditional-collective
        if rank == 1:
            dist.all_reduce(t)  # <- rank-conditional-collective
        """),
    "torch.load(weights_only=False) is an error": "import torch\nx = torch.load('a.pt', weights_only=False)  # <- unsafe-torch-load\n",
    "save in a helper called on rank 0, per-rank files, early exit": script("""\
        def save(model):
            torch.save(model.state_dict(), "model.pt")
        def save_rng():
            torch.save(torch.get_rng_state(), f"rng_{rank}.pt")
        def save_last(model):
            if rank != 0:
                return
            torch.save(model.state_dict(), "last.pt")
        model = nn.Linear(2, 2).to(device)
        if rank == 0:
            save(model)
        save_rng()
        save_last(model)
        """),
    "save in a helper called on every rank": script("""\
        def save(model):
            torch.save(model.state_dict(), "model.pt")  # <- save-on-every-rank
        model = nn.Linear(2, 2).to(device)
        save(model)
        """),
    "torch.save in a single-process script": "import torch\ntorch.save({}, 'x.pt')\n",
    "rendezvous literals in an mp.spawn script are needed": textwrap.dedent("""\
        import os
        import torch.distributed as dist
        import torch.multiprocessing as mp

        def worker(rank, world_size):
            os.environ["MASTER_ADDR"] = "localhost"
            os.environ["MASTER_PORT"] = "29500"
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(worker, args=(2,), nprocs=2)
        """),
    "rendezvous: a guarded default and a computed port": textwrap.dedent("""\
        import os
        import torch.distributed as dist
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(29500 + int(os.environ["LOCAL_RANK"]) // 8)
        os.environ.update({"MASTER_ADDR": "10.0.0.1"})  # <- hardcoded-rendezvous
        os.environ.update(MASTER_PORT="1234")  # the same decision: reported once, above
        dist.init_process_group("nccl")
        dist.destroy_process_group()
        """),
    "metric reduced through a helper of the file": script("""\
        def reduce_sum(x):
            t = torch.tensor([x], device=device)
            dist.all_reduce(t)
            return t.item()
        correct = 0
        for y in [torch.ones(3)]:
            correct += y.sum().item()
        correct = reduce_sum(correct)
        if rank == 0:
            print(correct)
        """),
    "a running training loss logged on rank 0 is progress logging, not reported": script("""\
        sampler = DistributedSampler(TensorDataset(torch.randn(8, 10)))
        running_loss = 0.0
        for step in range(10):
            loss = torch.rand(())
            running_loss += loss.item()
            if rank == 0 and step % 5 == 4:
                print(f"loss {running_loss / 5:.3f}")
                running_loss = 0.0
        """),
    "a rank under another name (self.gpu_id = LOCAL_RANK) guards a save": script("""\
        class Trainer:
            def __init__(self, model):
                self.gpu_id = int(os.environ["LOCAL_RANK"])
                self.model = model

            def save(self):
                torch.save(self.model.state_dict(), "checkpoint.pt")

            def train(self, epochs):
                for epoch in range(epochs):
                    if self.gpu_id == 0:
                        self.save()
        """),
    "a DataLoader class of the file's own, and an IterableDataset, are not torch's DataLoader": script("""\
        class DataLoader:
            def __init__(self, n):
                self.n = n
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                yield from range(rank, 100, dist.get_world_size())
        mine = DataLoader(3)
        stream = torch.utils.data.DataLoader(Stream(), batch_size=4)
        """),
    "a temporary file per process": script("""\
        import tempfile
        with tempfile.NamedTemporaryFile() as tmp:
            torch.save({"x": 1}, tmp)
        """),
    "the single-process 'fake' backend is not a distributed script": textwrap.dedent("""\
        import torch
        import torch.distributed as dist
        dist.init_process_group("fake", rank=0, world_size=8)
        device = torch.device("cuda:0")
        torch.save({}, "graph.pt")
        dist.destroy_process_group()
        """),
    "a sampler handed to a training function of another file (which may set its epoch)": script("""\
        from mylib import train
        dataset = TensorDataset(torch.randn(64, 10))
        sampler = DistributedSampler(dataset)
        loader = DataLoader(dataset, batch_size=8, sampler=sampler)
        for epoch in range(2):
            train(loader, sampler=sampler, epoch=epoch)
        """),
    "'nccl' in a decorator's comparison does not make a CPU function a GPU one": textwrap.dedent("""\
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        BACKEND = "gloo"

        def skip_if(cond):
            return lambda f: f

        @skip_if(BACKEND == "nccl")
        def test_cpu():
            torch.manual_seed(0)
            model = torch.nn.Linear(2, 2)
            ddp = DDP(model)
            return ddp

        def test_gpu(rank):
            x = torch.ones(1).cuda(rank)
            return x

        dist.init_process_group(BACKEND)
        dist.destroy_process_group()
        """),
}


def marked(text: str) -> list[tuple[str, int]]:
    return sorted(
        (rule, n)
        for n, line in enumerate(text.splitlines(), start=1)
        for rule in re.findall(r"# <- ([a-z-]+)", line)
    )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant(name: str) -> None:
    text = VARIANTS[name]
    assert sorted(found(text)) == marked(text)


def test_unseeded_init_follows_what_the_wrapper_does() -> None:
    no_seed = HEAD.replace("torch.manual_seed(0)\n", "")
    # DDP broadcasts rank 0's parameters at construction: the replicas start equal, nothing to report
    ddp = no_seed + "model = nn.Linear(4, 4).to(device)\nmodel = DDP(model, device_ids=[local_rank])\n" + TAIL
    assert lint_source(ddp, "train.py") == []
    alone = no_seed + "model = nn.Linear(4, 4).to(device)\n" + TAIL
    (f,) = lint_source(alone, "train.py")
    assert (f.rule, f.severity) == ("unseeded-init", "error")  # nothing broadcasts or wraps it
    assert "never broadcast or wrapped" in f.message
    # handed to a trainer of another file, which may wrap it: the file cannot tell
    assert (
        lint_source(no_seed + "from mylib import Trainer\nmodel = nn.Linear(4, 4)\nTrainer(model)\n" + TAIL)
        == []
    )
    sharded = (
        no_seed
        + "from torch.distributed.fsdp import fully_shard\nmodel = nn.Linear(4, 4)\nfully_shard(model)\n"
    )
    assert lint_source(sharded + TAIL, "train.py") == []  # one copy of each shard: no two replicas disagree
    tp = no_seed + textwrap.dedent("""\
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module


        class Toy(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(4, 4)
                self.head = nn.Linear(4, 2)


        model = Toy()
        parallelize_module(model, mesh, {"proj": ColwiseParallel()})
        """)
    (f,) = lint_source(tp + TAIL, "train.py")
    assert (f.rule, f.severity) == ("unseeded-init", "warning") and "head (outside the plan)" in f.message
    covered = tp.replace(
        '{"proj": ColwiseParallel()}', '{"proj": ColwiseParallel(), "head": ColwiseParallel()}'
    )
    assert lint_source(covered + TAIL, "train.py") == []
    # a seed that differs per rank is no seed for the model, even through a variable
    per_rank = HEAD.replace(
        "torch.manual_seed(0)\n", "seed = 7\nseed = seed + rank\ntorch.manual_seed(seed)\n"
    )
    assert [f.rule for f in lint_source(per_rank + "model = nn.Linear(4, 4)\n" + TAIL)] == ["unseeded-init"]
    (f,) = lint_source("import torch\nx = torch.load('a.pt')\n", "a.py", select=["unsafe-torch-load"])
    assert (f.rule, f.severity, f.line, f.col) == ("unsafe-torch-load", "warning", 2, 5)
    (f,) = lint_source("import torch\nx = torch.load('a.pt', weights_only=False)\n", "a.py", select=["ALL"])
    assert f.severity == "error"


# -- ignore comments ---------------------------------------------------------------------------------------


def test_ignore_comments() -> None:
    load = "import torch\nx = torch.load('a.pt')"
    assert found(load + "\n") == [("unsafe-torch-load", 2)]
    assert found(load + "  # paratrain: ignore[unsafe-torch-load]\n") == []
    assert found(load + "  # paratrain: ignore\n") == []  # every rule on the line
    assert found(load + "  # paratrain: ignore[data-parallel, unsafe-torch-load]\n") == []
    assert found(load + "  # noqa: E501  # paratrain: ignore[unsafe-torch-load]\n") == []
    assert found(load + "  # paratrain: ignore[data-parallel]\n") == [("unsafe-torch-load", 2)]
    # only comments count, not a string that looks like one; and only on the finding's own line
    assert found("import torch\nx = torch.load('# paratrain: ignore')\n") == [("unsafe-torch-load", 2)]
    assert found("import torch\n# paratrain: ignore\nx = torch.load('a.pt')\n") == [("unsafe-torch-load", 3)]


def test_select_and_ignore() -> None:
    text = "import torch\nfrom torch import nn\nm = nn.DataParallel(nn.Linear(2, 2))\nx = torch.load('a')\n"
    assert {f.rule for f in lint_source(text)} == {"data-parallel"}  # unsafe-torch-load is opt-in (hygiene)
    both = {"data-parallel", "unsafe-torch-load"}
    assert {f.rule for f in lint_source(text, extend_select=["hygiene"])} == both
    assert {f.rule for f in lint_source(text, select=["ALL"])} == both
    assert {f.rule for f in lint_source(text, extend_select=["PTL012"])} == both
    assert [f.rule for f in lint_source(text, select={"data-parallel"})] == ["data-parallel"]
    assert [f.rule for f in lint_source(text, select=["hygiene"])] == ["unsafe-torch-load"]
    assert [f.rule for f in lint_source(text, select=["ALL"], ignore={"data-parallel"})] == [
        "unsafe-torch-load"
    ]


# -- syntax errors -----------------------------------------------------------------------------------------


def test_syntax_error_is_a_finding_not_a_crash(tmp_path: Path) -> None:
    (f,) = lint_source("import torch\n\ndef broken(:\n    pass\n", "bad.py")
    assert (f.rule, f.severity, f.line, f.path) == ("syntax-error", "error", 3, "bad.py")
    assert f.col >= 1 and f.message and f.fix
    (tmp_path / "bad.py").write_text("x = (\n")
    (tmp_path / "nul.py").write_bytes(b"x = 1\x00\n")
    (tmp_path / "deep.py").write_text("x = " + "1+" * 5000 + "1\n")  # deeper than the parser recurses
    (tmp_path / "rot13.py").write_text("# coding: rot13\nx = 1\n")  # a codec that is not a text encoding
    (tmp_path / "ok.py").write_text("import torch.nn as nn\nm = nn.DataParallel(nn.Linear(2, 2))\n")
    report = lint_paths([tmp_path], select=["data-parallel"])  # still reported: the file was not checked
    assert report.files == 5
    assert [(f.rule, Path(f.path).name) for f in report.findings] == [
        ("syntax-error", "bad.py"),
        ("syntax-error", "deep.py"),
        ("syntax-error", "nul.py"),
        ("data-parallel", "ok.py"),  # the other files are still linted
        ("syntax-error", "rot13.py"),
    ]


# -- the CLI: text, JSON, exit codes -------------------------------------------------------------------------

BAD = "import torch\nfrom torch import nn\n\nmodel = nn.DataParallel(nn.Linear(4, 4))\nstate = torch.load('x.pt')\n"
CLEAN = "import torch\n\nstate = torch.load('x.pt', weights_only=True)\n"


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="paratrain lint")
    add_arguments(parser)
    return run(parser.parse_args(list(argv)))


def test_cli_text_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "train.py"
    bad.write_text(BAD)
    assert cli("--extend-select", "hygiene", str(bad)) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{bad}:4:9: data-parallel  nn.DataParallel runs every GPU")
    assert out[1].startswith("    fix: launch one process per GPU")
    assert out[2].startswith(f"{bad}:5:9: unsafe-torch-load  ")
    assert out[-1] == "Found 2 findings (0 errors, 2 warnings) in 1 file."
    clean = tmp_path / "ok.py"
    clean.write_text(CLEAN)
    assert cli(str(clean)) == 0
    assert capsys.readouterr().out.strip() == "All checks passed (1 file)."


def test_cli_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "train.py").write_text(BAD)
    (tmp_path / "pkg" / "sub" / "ok.py").write_text(CLEAN)
    (tmp_path / "pkg" / "notes.txt").write_text(BAD)  # not *.py: skipped in a directory
    (tmp_path / "pkg" / ".hidden").mkdir()
    (tmp_path / "pkg" / ".hidden" / "x.py").write_text(BAD)  # hidden directories are skipped
    assert cli("--json", "--extend-select", "hygiene", str(tmp_path / "pkg")) == 1
    out = capsys.readouterr().out
    payload = json.loads(out)  # exactly one JSON object, nothing else
    assert set(payload) == {"files", "findings"} and payload["files"] == 2
    assert [(f["rule"], f["line"], f["col"], f["severity"]) for f in payload["findings"]] == [
        ("data-parallel", 4, 9, "warning"),
        ("unsafe-torch-load", 5, 9, "warning"),
    ]
    for f in payload["findings"]:
        assert list(f) == ["path", "line", "col", "rule", "severity", "message", "fix"]
        assert f["path"].endswith("train.py") and f["message"] and f["fix"]
    assert cli("--json", str(tmp_path / "pkg" / "sub")) == 0
    assert json.loads(capsys.readouterr().out) == {"files": 1, "findings": []}


def test_cli_select_ignore_and_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "train.py"
    bad.write_text(BAD)
    assert cli("--json", "--select", "unsafe-torch-load", str(bad)) == 1
    assert [f["rule"] for f in json.loads(capsys.readouterr().out)["findings"]] == ["unsafe-torch-load"]
    assert cli("--json", "--select", "PTL001", str(bad)) == 1
    assert [f["rule"] for f in json.loads(capsys.readouterr().out)["findings"]] == ["data-parallel"]
    assert cli("--ignore", "data-parallel,unsafe-torch-load", str(bad)) == 0
    capsys.readouterr()


def test_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(str(tmp_path / "missing.py")) == 2
    err = capsys.readouterr().err
    assert "no such file or directory" in err and "missing.py" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    (tmp_path / "a.py").write_text(CLEAN)
    assert cli("--select", "unsafe-torch-lod", str(tmp_path / "a.py")) == 2
    assert "Did you mean 'unsafe-torch-load'?" in capsys.readouterr().err
    assert cli() == 2
    assert "no PATH given" in capsys.readouterr().err


def test_cli_list_rules(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("--list-rules") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [*RULE_IDS, "syntax-error"]
    assert lines[0].split()[1:4] == ["PTL001", "default", "warning"]
    assert cli("--list-rules", "--json") == 0
    rules = json.loads(capsys.readouterr().out)["rules"]
    assert rules[11] == {
        "id": "unsafe-torch-load",
        "code": "PTL012",
        "tier": "hygiene",
        "severity": "warning",
        "summary": RULES["unsafe-torch-load"].summary,
    }


def test_python_dash_m_subprocess(tmp_path: Path) -> None:
    bad = tmp_path / "train.py"
    bad.write_text(BAD)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "paratrain.lint"]
    done = subprocess.run([*cmd, "--json", str(bad)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["files"] == 1
    done = subprocess.run([*cmd, str(tmp_path / "nope")], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "no such file or directory" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    # pure source analysis: linting imports no torch
    probe = "import sys, paratrain.lint as l; l.lint_paths([sys.argv[1]]); print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe, str(bad)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.stdout.strip() == "False", done.stderr


# -- the flake8 plugin ----------------------------------------------------------------------------------------


def test_flake8_plugin_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no pyproject.toml above: the default tier
    text = BAD + "ok = torch.load('y.pt')  # paratrain: ignore[unsafe-torch-load]\n"
    checker = ParatrainChecker(ast.parse(text), "train.py", text.splitlines(keepends=True))
    results = list(checker.run())
    assert [(line, col, msg.split()[0]) for line, col, msg, _ in results] == [(4, 8, "PTL001")]
    assert all(kind is ParatrainChecker for *_, kind in results)
    assert results[0][2].endswith("[data-parallel]")
    assert ParatrainChecker.name == "paratrain-lint" and ParatrainChecker.version
    # [tool.paratrain.lint] applies to the plugin as to the CLI: the hygiene tier on demand
    (tmp_path / "pyproject.toml").write_text('[tool.paratrain.lint]\nextend-select = ["hygiene"]\n')
    results = list(ParatrainChecker(ast.parse(text), "train.py", text.splitlines(keepends=True)).run())
    assert [(line, msg.split()[0]) for line, _, msg, _ in results] == [(4, "PTL001"), (5, "PTL012")]
    # without `lines` (flake8 always passes them) it reads the file itself; a missing file still works
    assert len(list(ParatrainChecker(ast.parse(BAD), "/nonexistent/train.py").run())) == 2


# -- no false positives on correct code ------------------------------------------------------------------------

CORRECT_SCRIPTS: dict[str, str] = {
    "ddp_full.py": '''\
"""Train a small CNN with DDP under torchrun: the correct version of every pitfall."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(self.drop(x.flatten(1)))


def setup() -> tuple[int, int, torch.device]:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device(f"cuda:{local_rank}")
    else:
        device = torch.device("cpu")
    return dist.get_rank(), local_rank, device


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    correct = torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            correct += (model(x).argmax(1) == y).sum()
            total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    model.train()
    return (correct / total).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()

    rank, local_rank, device = setup()
    torch.manual_seed(1234)

    data = TensorDataset(torch.randn(512, 1, 8, 8), torch.randint(0, 10, (512,)))
    train_sampler = DistributedSampler(data, shuffle=True, seed=1234)
    train_loader = DataLoader(data, batch_size=16, sampler=train_sampler, num_workers=0)
    test_loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=False))

    model = Net()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if args.resume:
        state = torch.load(args.resume, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        running = torch.zeros((), device=device)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (step + 1) % args.accum == 0
            if not last_micro:
                with ddp_model.no_sync():
                    loss = criterion(ddp_model(x), y) / args.accum
                    loss.backward()
            else:
                loss = criterion(ddp_model(x), y) / args.accum
                loss.backward()
            running += loss.detach()
            if last_micro:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        dist.all_reduce(running, op=dist.ReduceOp.SUM)
        accuracy = evaluate(ddp_model, test_loader, device)
        if rank == 0:
            mean_loss = running.item() / dist.get_world_size()
            print(f"epoch {epoch}: loss {mean_loss:.4f} accuracy {accuracy:.2%}")
            torch.save({"model": model.state_dict(), "epoch": epoch}, "checkpoint.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
''',
    "fsdp2_meta.py": '''\
"""FSDP2 on a meta-device model, sharded per block, DCP checkpoints: every rank takes part in the saves."""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    mesh = init_device_mesh(device_type, (int(os.environ["WORLD_SIZE"]),))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device_type)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(256, 64), torch.randn(256, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler, drop_last=True)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x.to(device_type)), y.to(device_type))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=f"ckpt/{epoch}")
        if dist.get_rank() == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
''',
    "spawn_gloo.py": '''\
"""mp.spawn-style script (no torchrun): it sets its own rendezvous, and uses the 'rank 0 first' barrier."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset


def prepare_data(rank: int) -> TensorDataset:
    if rank != 0:
        dist.barrier()  # wait while rank 0 downloads
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    if rank == 0:
        dist.barrier()  # release the others
    return data


def worker(rank: int, world_size: int) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "29512"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    data = prepare_data(rank)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    shard = Subset(data, range(rank, len(data), world_size))
    for x, y in DataLoader(shard, batch_size=8):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    torch.save(torch.get_rng_state(), f"rng_rank{rank}.pt")
    if rank == 0:
        # rank 0 evaluates on the whole set by itself: its counts are the global ones
        test_loader = DataLoader(data, batch_size=16)
        total_loss = 0.0
        seen = 0
        with torch.no_grad():
            for x, y in test_loader:
                total_loss += nn.functional.mse_loss(model.module(x), y, reduction="sum").item()
                seen += len(y)
        print(f"test loss {total_loss / seen:.4f}")
        torch.save(model.module.state_dict(), "model.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2,), nprocs=2)
''',
    "nanogpt_style.py": '''\
"""nanoGPT's structure: master_process guard, require_backward_grad_sync accumulation, a while loop."""

import os

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="nccl")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    master_process = ddp_rank == 0
else:
    master_process = True
    device = "cuda:0"
torch.manual_seed(1337)
gradient_accumulation_steps = 8

model = torch.nn.Linear(32, 32)
model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])
raw_model = model.module if ddp else model

iter_num = 0
while iter_num < 100:
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        loss = model(torch.randn(4, 32, device=device)).pow(2).mean() / gradient_accumulation_steps
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master_process and iter_num % 10 == 0:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}")
        checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
        torch.save(checkpoint, os.path.join("out", "ckpt.pt"))
    iter_num += 1

if ddp:
    destroy_process_group()
''',
}


@pytest.mark.parametrize("name", list(CORRECT_SCRIPTS))
def test_no_findings_on_correct_scripts(name: str) -> None:
    text = CORRECT_SCRIPTS[name]
    compile(text, name, "exec")  # they are real Python
    assert lint_source(text, name) == []


def test_no_findings_on_the_examples() -> None:
    examples = sorted((REPO / "examples").glob("*.py"))
    assert examples
    report = lint_paths([REPO / "examples"])
    assert report.files == len(examples)
    assert report.findings == [], "\n".join(
        f"{f.path}:{f.line}: {f.rule} {f.message}" for f in report.findings
    )
