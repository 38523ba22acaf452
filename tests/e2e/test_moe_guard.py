"""`launch --guard` names the rank that did not reach an MoE layer's all-to-all, and the call.

A script (2 Gloo ranks) splits one MoE block's experts with ``paratrain.setup(..., strategy="ep")``; after
one forward on every rank, rank 1 skips the next one, so it never enters the dispatch's first all-to-all (the
exchange of the rows per expert) while rank 0 waits in it. The guard's hang post-mortem must name rank 1, the
``all_to_all_single`` and the script line of the forward that dispatches (paratrain's own frames are skipped).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_guard import guard, guard_lines, line_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # ~40 s on 2 loaded cores: the launcher and 2 workers start

SKIPPED_DISPATCH = """
import os, time
import torch
from torch import nn
from paratrain.models.llama import LlamaConfig
from paratrain.models.moe import MoE
from paratrain.parallel import setup
from paratrain.runtime import init

cfg = LlamaConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=32, vocab_size=32, max_seq_len=8,
                  n_experts=4, top_k=2, moe_hidden=16)
torch.manual_seed(0)
block = MoE(cfg)
block.init_weights(0.02, 0.02)
model, _, strategy = setup(nn.Sequential(block), None, strategy="ep", ctx=init(seed=None))
x = torch.randn(2, 4, 16)
model(x)  # FIRST: every rank dispatches its tokens
if strategy.ctx.rank != 1:
    model(x)  # DISPATCH: the MoE block's all-to-alls
else:
    while not os.path.exists("never-written"):  # WAIT: rank 1 skips the dispatch
        time.sleep(0.1)
"""


@pytest.mark.timeout(200)
def test_guard_names_the_rank_that_skipped_the_moe_all_to_all(tmp_path: Path) -> None:
    proc, _, out = guard(tmp_path, SKIPPED_DISPATCH, 2, "--hang-timeout", "3", timeout=190)
    assert proc.returncode != 0, out
    lines = guard_lines(out)
    dispatch = line_of(SKIPPED_DISPATCH, "# DISPATCH")
    assert lines and lines[0].startswith(
        f"paratrain guard: hang: rank 1 never reached collective #4 (all_to_all_single int64[uneven] at "
        f"train.py:{dispatch}); rank 0 is waiting in it"
    ), out
    # the forward every rank ran: its two all-to-alls of the rows (dispatch, combine) were #2 and #3
    first = line_of(SKIPPED_DISPATCH, "# FIRST")
    assert f"its last collective was #3 (all_to_all_single float32[uneven] at train.py:{first})" in out, out
    wait = line_of(SKIPPED_DISPATCH, "# WAIT")
    assert f"it is now at train.py:{wait}" in out or f"it is now at train.py:{wait + 1}" in out, out
