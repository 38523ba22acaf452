"""zero2's step peak at the default bucket size: within 10% of 4Ψ + 12Ψ/N + one bucket + activations, and
below 0.6× ddp's, on 3 Gloo ranks (an MLP 64 → 2048×5 → 10, Ψ = 16.9M, fp32 AdamW, three 25 MiB-cap buckets).

The peak is what the trainer reports (``train.memory.measure_peak``: MemTracker over one step after a warm-up
step). What the formula leaves out and the peak holds: the one fresh gradient being packed into the send
buffer during backward (the largest is 16.8 MB here) while the shards of the buckets not yet reduced are
still missing from 4Ψ/N. Gloo's own reduce-scatter (an all-reduce of a clone of its input) would add one full
bucket, and a second all-gather buffer alive at the next allocation another: 1.21× the formula with either.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from paratrain.models.mlp import MLP

RANKS = 3


def peaks(hidden: int, bucket_cap_mb: float | None, ctx: Any = None) -> dict[str, Any]:
    """zero2's and ddp's measured step peaks on this rank, with the formula's terms (``ctx``: a running
    process group's, else one is started)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from paratrain.parallel import setup
    from paratrain.runtime import init
    from paratrain.train.memory import measure_peak

    ctx = ctx if ctx is not None else init(seed=0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
    out: dict[str, Any] = {}
    for strategy in ("zero2", "ddp"):
        torch.manual_seed(0)
        model = MLP(64, hidden, 5, 10)
        cap = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        opt = torch.optim.AdamW(model.parameters())
        model, opt, _ = setup(model, opt, strategy=strategy, ctx=ctx, **cap)

        def step(model: nn.Module = model, opt: Any = opt) -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        step()  # warm-up: the optimizer state exists, as at every later step
        # the lower of two measured steps: now and then (1 fresh-clone CI run in 3 here) Gloo's completed work
        # object still holds the previous bucket's buffer when the next one is allocated, a timing race; the
        # buffer a loop variable kept alive (the bug this guards against) is there at every step
        out[strategy] = min(measure_peak(step, model, opt)[1] or 0 for _ in range(2))
        if strategy == "zero2":
            out["psi"] = sum(p.numel() for p in model.parameters())
            out["buckets"] = len(opt.buckets)
            out["bucket"] = max(b.segment * RANKS * 4 for b in opt.buckets)  # the largest send buffer
            tracker = MemTracker()
            with tracker:
                model(x)  # what forward keeps for backward
            peak = tracker.get_tracker_snapshot("peak")[x.device]
            out["activations"] = sum(v for k, v in peak.items() if getattr(k, "value", "") == "Activation")
        del model, opt, step
    return out


def check_peaks(r: dict[str, Any]) -> None:
    psi, n = r["psi"], RANKS
    assert r["buckets"] == 3, r  # two hidden layers a bucket: a send buffer is a third of the gradients
    formula = 4 * psi + 12 * psi / n + r["bucket"] + r["activations"]
    assert r["zero2"] <= 1.10 * formula, (r["zero2"] / formula, r)
    # a send buffer is alive at some moment
    assert r["zero2"] >= formula - r["bucket"], (r["zero2"] / formula, r)
    assert r["zero2"] < 0.6 * r["ddp"], (r["zero2"] / r["ddp"], r)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_zero2_peak_at_the_default_bucket_size(dist_run: Any) -> None:
    # ~45 s at load 10 on 2 cores; the default tier checks the same layout at 1/16 of the size inside
    # tests/dist/test_zero.py's zero2 run (hidden 512, 25/16 MiB buckets)
    for r in dist_run(peaks, RANKS, 2048, None, timeout_s=170):
        check_peaks(r)
