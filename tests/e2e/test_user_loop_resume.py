"""``paratrain.save_state``/``load_state`` in a user's own loop: a run stopped after step 3 and resumed ends
with the same parameters as an uninterrupted run (model, optimizer, sampler position, scheduler and random
numbers restored), on 2 ranks under ``zero3``."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.e2e

SCRIPT = """
import hashlib, sys
import torch
from torch import nn
import paratrain
from paratrain.data import DistributedBatchSampler

stop_at, ckpt = int(sys.argv[1]), sys.argv[2]
ctx = paratrain.init(seed=0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
model, optimizer, strategy = paratrain.setup(model, optimizer, strategy="zero3", ctx=ctx, shard_units="root")
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
sampler = DistributedBatchSampler(96, 16, strategy.dp_rank, strategy.dp_size, seed=0)
state = paratrain.load_state(ckpt, model, optimizer, sampler=sampler, scheduler=scheduler)
start = state["step"] if state else 0
for step in range(start + 1, stop_at + 1):
    idx = sampler.next_batch()
    loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    if step % 3 == 0:
        paratrain.save_state(ckpt, model, optimizer, step, sampler=sampler, scheduler=scheduler, extra={"loss": loss.item()})
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if ctx.rank == 0:
    h = hashlib.sha256(b"".join(v.float().numpy().tobytes() for _, v in sorted(sd.items()))).hexdigest()
    print("PARAMS", start, h, flush=True)
paratrain.shutdown()
"""


@pytest.mark.timeout(400)
def test_a_resumed_user_loop_ends_like_an_uninterrupted_one(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text(textwrap.dedent(SCRIPT))

    def run(stop: int, ckpt: str) -> tuple[str, str]:
        out = run_cli(
            "launch", "--nproc-per-node", "2", "loop.py", str(stop), ckpt, cwd=tmp_path, timeout=120
        )
        _, start, digest = next(ln for ln in out.stdout.splitlines() if ln.startswith("PARAMS")).split()
        return start, digest

    start, straight = run(6, "whole")
    assert start == "0"
    # The run stopped after step 3 is the uninterrupted run's step-3 checkpoint: the same loop wrote it, so
    # it is that run's state after step 3 (one launch fewer than training 3 steps apart).
    halves = tmp_path / "halves"
    shutil.copytree(tmp_path / "whole", halves)
    shutil.rmtree(halves / "step_00000006")
    assert (halves / "latest").read_text().strip() == "step_00000006"
    (halves / "latest").write_text("step_00000003\n")
    start, resumed = run(6, "halves")
    assert start == "3"  # it did resume
    assert resumed == straight
