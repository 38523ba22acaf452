"""``--activation-checkpointing selective`` (op-level) and ``selective:N`` train exactly like no checkpointing
under data-parallel and model-parallel strategies (2 Gloo ranks, tiny Llama, losses and parameters within 1e-5),
and the measured peak of a step lies between ``full`` and ``none`` (with the same training on one process, in
the default tier; the 2-rank strategy grid is in the slow tier)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist._reference import make_cfg

LM = ["model.name=llama-debug", "model.dim=32", "model.n_layers=4", "model.ffn_hidden=64", "model.n_heads=4",
      "model.n_kv_heads=2", "data.name=python-stdlib", "data.max_bytes=20000", "data.seq_len=32",
      "train.steps=3", "train.batch_size=8", "optimizer.lr=0.01"]  # fmt: skip
STRATEGIES = ["ddp", "zero3", "fsdp+tp", "pp"]


def _fit(cases: list[list[str]], run_root: str) -> list[dict[str, Any]]:
    from tests.dist._reference import train_cases

    return [{"losses": o["losses"], "params": o["params"]} for o in train_cases(cases, run_root)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_selective_checkpointing_equals_none_under_every_strategy(dist_run: Any, tmp_path: Path) -> None:
    modes = {s: ("none", "selective") for s in STRATEGIES} | {"pp": ("none", "selective", "selective:2")}
    cases = [[*LM, f"strategy.name={s}", f"train.activation_checkpointing={ac}"] for s in STRATEGIES
             for ac in modes[s]]  # fmt: skip
    results = dist_run(_fit, 2, cases, str(tmp_path), timeout_s=280)[0]
    i = 0
    for s in STRATEGIES:
        n, ref = len(modes[s]), results[i]
        for case, got in zip(cases[i + 1 : i + n], results[i + 1 : i + n], strict=True):
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-5), case
            for name, want in ref["params"].items():
                torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-5, msg=str(case))
        i += n


def _peak(tmp_path: Path, ac: str) -> tuple[int, list[float], dict[str, torch.Tensor]]:
    from paratrain.runtime import init
    from paratrain.train.trainer import full_parameters
    from paratrain.train.worker import build_trainer

    cfg = make_cfg(*LM, "data.seq_len=128", "model.n_layers=6", "strategy.name=single", "train.steps=2",
                   f"train.activation_checkpointing={ac}")  # fmt: skip
    trainer = build_trainer(cfg, init(device="cpu", seed=0), tmp_path / ac.replace(":", "-"))
    res = trainer.fit()
    peak, params = res.extra["peak_bytes_per_rank"], full_parameters(trainer.model)
    assert peak is not None and params is not None
    return int(peak), res.losses, params


@pytest.mark.timeout(200)
def test_selective_peak_lies_between_full_and_none(tmp_path: Path) -> None:
    runs = {ac: _peak(tmp_path, ac) for ac in ("none", "selective", "selective:2", "full")}
    peaks = {ac: r[0] for ac, r in runs.items()}
    for ac in ("selective", "selective:2"):  # the same training as without checkpointing, on one process
        assert runs[ac][1] == pytest.approx(runs["none"][1], rel=1e-5, abs=1e-5), ac
        for name, want in runs["none"][2].items():
            torch.testing.assert_close(runs[ac][2][name], want, rtol=1e-5, atol=1e-5, msg=ac)
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks
    assert peaks["full"] < peaks["selective:2"] < peaks["none"], peaks
    # the planner's op-by-op model of each mode (plan/implementation.py) predicts the measured peak
    from paratrain.plan.api import Workload, plan
    from paratrain.plan.model import shape_from_config, spec_from_shape
    from paratrain.spec.hardware import preset
    from paratrain.spec.llama import resolve_config

    shape = dict(dim=32, n_layers=6, ffn_hidden=64, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=256)
    spec = spec_from_shape(shape_from_config(resolve_config("llama-debug", shape)), "llama")
    for ac, measured in peaks.items():
        w = Workload(batch_size=8, seq_len=128, activation_checkpointing=ac, precision="fp32")
        predicted = plan(spec, preset("cpu-local").with_gpus(1), w, "single")["plans"][0]["bytes_per_rank"][
            "peak"
        ]
        assert predicted == pytest.approx(measured, rel=0.10), (ac, predicted, measured)


MOE = ["model.name=llama-moe-debug", "data.name=python-stdlib", "data.max_bytes=20000", "data.seq_len=32",
       "train.steps=3", "train.batch_size=8", "optimizer.lr=0.01"]  # fmt: skip


EXPERT_CASES = {
    2: [("ep", []), ("fsdp+ep", [])],
    4: [
        ("fsdp+ep+pp", ["strategy.pp=2", "strategy.ep=2"]),
        ("fsdp+tp+ep", ["strategy.tp=2", "strategy.ep=2"]),
    ],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_selective_checkpointing_equals_none_under_expert_parallelism(
    dist_run: Any, tmp_path: Path, world: int
) -> None:
    """An MoE model under the expert-parallel strategies: the experts' own FSDP unit sits inside the checkpointed
    block, and its hooks run other ops (profiler spans, the parameter gather's copies) while recomputing than
    in forward; selective checkpointing must still train like none (it stopped in backward before)."""
    cases = [[*MOE, f"strategy.name={s}", *extra, f"train.activation_checkpointing={ac}"]
             for s, extra in EXPERT_CASES[world] for ac in ("none", "selective")]  # fmt: skip
    results = dist_run(_fit, world, cases, str(tmp_path), timeout_s=280)[0]
    for i, (s, _) in enumerate(EXPERT_CASES[world]):
        ref, got = results[2 * i], results[2 * i + 1]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-5), s
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-5, msg=s)


def _compiled_runs(root: str) -> dict[str, Any]:
    """Eager none, compiled full and compiled selective through the worker's path, in a process of its own
    (inductor raises the interpreter's recursion limit for good)."""
    from paratrain.runtime import init
    from paratrain.train.trainer import full_parameters
    from paratrain.train.worker import build_trainer

    runs = {}
    for ac, compiled in (("none", "false"), ("full", "true"), ("selective", "true")):
        cfg = make_cfg(*LM, "model.n_layers=2", "strategy.name=single", "train.steps=2", f"train.compile={compiled}",
                       f"train.activation_checkpointing={ac}")  # fmt: skip
        trainer = build_trainer(cfg, init(device="cpu", seed=0), Path(root) / ac)
        res = trainer.fit()
        runs[ac] = {"losses": res.losses, "params": full_parameters(trainer.model)}
    return runs


@pytest.mark.timeout(300)
def test_checkpointing_under_compile_trains_like_eager(dist_run: Any, tmp_path: Path) -> None:
    """``--compile`` with ``--activation-checkpointing full`` and ``selective`` (torch.compile accepts a
    checkpoint's contexts only as two dispatch modes; both runs stopped while compiling before): the same
    training as the eager run without checkpointing, on one process."""
    runs = dist_run(_compiled_runs, 1, str(tmp_path), timeout_s=280)[0]
    for ac in ("full", "selective"):
        assert runs[ac]["losses"] == pytest.approx(runs["none"]["losses"], rel=1e-4), ac
        for name, want in runs["none"]["params"].items():
            torch.testing.assert_close(runs[ac]["params"][name], want, rtol=1e-4, atol=1e-4, msg=ac)


@pytest.mark.timeout(300)
def test_compile_under_expert_parallelism_trains_like_eager(dist_run: Any, tmp_path: Path) -> None:
    """``--compile`` under ``ep``: the expert dispatch (a data-dependent all-to-all over a process group) runs
    eagerly between the compiled parts (Dynamo stopped on it before); the run trains like the eager one."""
    cases = [[*MOE, "strategy.name=ep", f"train.compile={c}"] for c in ("false", "true")]
    eager, compiled = dist_run(_fit, 2, cases, str(tmp_path), timeout_s=280)[0]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    for name, want in eager["params"].items():
        torch.testing.assert_close(compiled["params"][name], want, rtol=1e-4, atol=1e-4, msg=name)
