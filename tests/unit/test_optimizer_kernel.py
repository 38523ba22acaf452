"""``optimizer.implementation``: which torch kernel runs the update, what it does to the param groups, and the
planner's temporaries for each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain.config import RunConfig
from paratrain.errors import ConfigError
from paratrain.plan import peak as pk
from paratrain.train.optim import build_optimizer, fused_refusal, set_implementation


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(impl: str, optimizer: str = "adamw", steps: int = 4) -> tuple[torch.nn.Module, str]:
    model = _model()
    cfg = RunConfig().override([f"optimizer.name={optimizer}", f"optimizer.implementation={impl}"])
    opt = build_optimizer(model, cfg)
    chosen = set_implementation(opt, cfg.optimizer.implementation)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, chosen


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_auto_is_fused_and_equals_the_other_kernels_up_to_rounding(optimizer: str) -> None:
    ref, chosen = _train("for-loop", optimizer)
    assert chosen == "for-loop"
    for impl, want in (("auto", "fused"), ("fused", "fused"), ("foreach", "foreach")):
        got, chosen = _train(impl, optimizer)
        assert chosen == want
        for a, b in zip(got.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the update moved the parameters: the comparison above is not between untouched copies
    assert any(not torch.equal(a, b) for a, b in zip(ref.parameters(), _model().parameters(), strict=True))


def test_the_choice_is_set_on_every_group_and_applied_again_over_a_loaded_state() -> None:
    model = _model()
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}])
    assert set_implementation(opt, "auto") == "fused"
    assert all(g["fused"] is True and g["foreach"] is False for g in opt.param_groups)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    for g in saved["param_groups"]:  # a checkpoint of a run that used the single-tensor loop
        g["fused"], g["foreach"] = None, None
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["fused"] is None
    first = next(iter(opt.state.values()))
    first["step"] = first["step"].double()  # a counter the fused kernel cannot read
    assert set_implementation(opt, "fused") == "fused"
    assert all(
        st["step"].dtype == torch.float32 and st["step"].device == p.device for p, st in opt.state.items()
    )
    assert set_implementation(opt, "for-loop") == "for-loop"
    assert all(g["fused"] is False and g["foreach"] is False for g in opt.param_groups)


def test_fused_is_refused_naming_why_and_auto_falls_back() -> None:
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2)), p])
    why = fused_refusal(opt)
    assert why is not None and "floating-point" in why
    with pytest.raises(
        ConfigError, match="optimizer.implementation=fused cannot run here: a parameter is not"
    ):
        set_implementation(opt, "fused")
    assert set_implementation(opt, "auto") == "for-loop"  # torch's own default on the CPU
    assert all(g["fused"] is False and g["foreach"] is None for g in opt.param_groups)


def test_an_unknown_implementation_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="implementation"):
        RunConfig().override(["optimizer.implementation=apex"])


def test_the_planner_counts_each_kernels_temporaries() -> None:
    assert pk.optimizer_kernel("adamw", "auto", cpu=True) == "fused"
    assert pk.optimizer_kernel("sgd", "fused", cpu=False) == "fused"
    assert pk.optimizer_kernel("adamw", "for-loop", cpu=False) == "for-loop"
    assert pk.optimizer_kernel("adamw", "foreach", cpu=True) == "foreach"
    base = dict(states=None, on_device=True, activations=0.0, psi=1000.0, sharding="full", n=4, dp=4, d=None,
                largest_tensor=100.0, optimizer="adamw")  # fmt: skip
    shape = {k: pk.StepShape(**base, optimizer_kernel=k) for k in ("fused", "for-loop", "foreach")}  # type: ignore[arg-type]
    assert pk.optimizer_temporaries(shape["fused"]) == 0.0
    assert pk.optimizer_temporaries(shape["for-loop"]) == 2 * 100.0 * 4  # sqrt and its quotient, fp32
    assert pk.optimizer_temporaries(shape["foreach"]) == 1000.0 / 4 * 4  # _foreach_sqrt of the local states


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--strategy", "ep", "--model", "llama-moe-debug", "--data", "python-stdlib"), "under ep: its experts"),
        (("--strategy", "zero3", "--optimizer", "sgd"), "for SGD under zero3"),
        (("--strategy", "fsdp+tp", "--optimizer", "sgd", "--model", "llama-debug", "--data", "python-stdlib"),
         "for SGD under fsdp+tp"),
    ],
)  # fmt: skip
def test_an_explicit_fused_kernel_that_cannot_run_is_refused_before_launch(
    cli_main: Any, tmp_path: Path, args: tuple[str, ...], words: str
) -> None:
    """The worker's refusal (above), decided from the strategy before any process starts: one line, exit 2,
    no run directory. ``auto`` launches these runs with the fallback instead."""
    proc = cli_main("train", *args, "--nproc-per-node", "2", "--steps", "1", "--run-dir", "run",
                    "--set", "optimizer.implementation=fused", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "optimizer.implementation=auto" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
