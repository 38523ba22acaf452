"""``train.memory.measure_peak``: the live bytes of one step, against bounds derived by hand.

The step is a pipeline's shape: one module runs forward on three micro-batches before a single backward
(GPipe), which MemTracker's per-module bookkeeping cannot follow; ``by_module=False`` tracks storages only.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from paratrain.train.memory import measure_peak

D, B, M = 256, 64, 3  # features, micro-batch rows, micro-batches
W = D * D * 4  # the weight (fp32, no bias)
X = B * D * 4  # one micro-batch's input (saved for the weight's gradient) and one output


def _gpipe_step(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(B, D, generator=g) for _ in range(M)]  # created in the step: tracked
    loss = sum(model(x).square().mean() for x in xs)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    opt.step()
    return loss.detach()


def test_storage_only_tracking_follows_a_module_run_once_per_micro_batch() -> None:
    model = nn.Linear(D, D, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: the optimizer adds nothing
    loss, peak = measure_peak(lambda: _gpipe_step(model, opt), model, opt, by_module=False)
    assert torch.isfinite(loss)
    assert peak is not None
    # Saved for backward over all M micro-batches: each input (for the weight's gradient) and each output
    # (for square's gradient). In backward, next to those: the weight's gradient, a weight-sized product
    # before it is accumulated, and one micro-batch's gradient chain (d square, d output: 2 X). So the
    # peak is 3W + 2MX + 2X (plus the scalar loss); the floor leaves out everything backward creates.
    floor = 2 * W + 2 * M * X
    ceiling = 3 * W + 2 * M * X + 3 * X
    assert floor <= peak <= ceiling, (floor, peak, ceiling)


def test_module_tracking_and_storage_tracking_agree_on_a_plain_step() -> None:
    """On a step MemTracker can follow by module (one forward), both modes see the same storages."""
    peaks = []
    for by_module in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, D, bias=False), nn.ReLU(), nn.Linear(D, D, bias=False))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4 * B, D)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt, x: torch.Tensor = x) -> None:
            model(x).square().mean().backward()
            opt.step()

        _, peak = measure_peak(step, model, opt, by_module=by_module)
        peaks.append(peak)
    assert peaks[0] is not None and peaks[0] == peaks[1]


def test_gradients_freed_in_backward_raise_no_tracker_warning_and_other_warnings_still_show() -> None:
    """zero2 frees each gradient in its post-accumulate hook (after the reduce-scatter), so MemTracker's own
    hook then finds ``p.grad is None`` and warns on every rank; that one warning is filtered, no other."""
    model = nn.Linear(D, D, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))

    def step() -> torch.Tensor:
        loss = model(torch.ones(B, D)).square().mean()
        loss.backward()
        warnings.warn("a warning of the step itself", UserWarning, stacklevel=1)
        return loss.detach()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, peak = measure_peak(step, model, opt)
    messages = [str(w.message) for w in caught]
    assert peak is not None
    assert not [m for m in messages if "traceable wrapper-subclass" in m], messages
    assert "a warning of the step itself" in messages
