"""tp, fsdp+tp, pp (gpipe, 1f1b, interleaved-1f1b), fsdp+pp and fsdp+tp+pp against one process.

The reference is a plain torch loop (``Llama`` + AdamW + next-token cross-entropy over the *global* batch,
``clip_grad_norm_``), independent of paratrain's strategies and trainer. Every distributed case builds the
same model from the same seed, goes through ``paratrain.setup`` and ``Strategy.forward_backward`` (the
strategy owns the step: a pipeline schedule runs forward and backward itself), takes its data-parallel
rank's rows of each global batch, and must match the reference's losses for every step and its final
parameters (gathered to full tensors) within rel 1e-4 in fp32. All cases of one world size share one
process group (one spawn); at 4 ranks the same group also saves an ``fsdp+tp`` checkpoint and resumes it
under ``zero3``, and this process resumes that under ``single``.

The default tier (CI) runs 3 and 4 ranks: every model-parallel strategy and every pipeline schedule, and a
checkpoint resharded across layouts; ``slow`` adds 2 ranks (more tp options) and longer resharding chains.
Each test declares what it holds to the reference with ``@pytest.mark.equivalence`` (checked against the
strategy registry by tests/test_strategy_coverage.py).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.models.llama import Llama, LlamaConfig

pytestmark = [pytest.mark.dist]

CFG = LlamaConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=16)
SEQ, BATCH, STEPS, LR = 16, 8, 3, 1e-2
TOL = 1e-4


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences (``next = 5 * token + 3 mod V`` from a random start), so the loss falls fast and
    the loss curve, not only its first point, tells strategies apart."""
    g = torch.Generator().manual_seed(3)
    ids = torch.empty(BATCH * STEPS, SEQ + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, CFG.vocab_size, (BATCH * STEPS,), generator=g)
    for i in range(1, SEQ + 1):
        ids[:, i] = (5 * ids[:, i - 1] + 3) % CFG.vocab_size
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())


def _model(cfg: LlamaConfig = CFG) -> Llama:
    torch.manual_seed(0)
    return Llama(cfg)


def reference(clip: float | None = None, steps: int = STEPS) -> dict[str, Any]:
    """One process, the whole global batch per step."""
    x, y = _tokens()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for t in range(steps):
        opt.zero_grad()
        loss = _lm_loss(model(x[t * BATCH : (t + 1) * BATCH]), y[t * BATCH : (t + 1) * BATCH])
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _train(
    strategy: str, options: dict[str, Any], accum: int = 1, clip: float | None = None
) -> dict[str, Any]:
    """On every rank: setup(strategy), then the trainer's step through Strategy.forward_backward."""
    from paratrain.data import Batch
    from paratrain.parallel import model_state_bytes, setup
    from paratrain.runtime import init
    from paratrain.train.precision import Precision
    from paratrain.train.trainer import full_parameters

    t0 = time.perf_counter()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, strat = setup(model, opt, strategy=strategy, ctx=init(seed=None), **options)
    precision = Precision("fp32", torch.device("cpu"))
    x, y = _tokens()
    n, r = strat.dp_size, strat.dp_rank
    local = BATCH // n
    losses = []
    for t in range(STEPS):
        lo = t * BATCH + r * local
        batch = Batch(x[lo : lo + local], y[lo : lo + local])
        opt.zero_grad(set_to_none=True)
        loss = strat.forward_backward(model, batch, _lm_loss, precision, accum).detach().clone()
        if clip is not None:
            strat.clip_grad_norm(model, clip)
        opt.step()
        if n > 1:
            dist.all_reduce(loss, group=strat.dp_group)
        losses.append(float(loss) / n)
    held = torch.tensor([model_state_bytes(model, opt)])
    dist.all_reduce(held, op=dist.ReduceOp.SUM)
    # a pipeline's stages after the step: the micro-batches' outputs torch's schedule would keep for step()'s
    # return value (return_outputs=True) until the next step; the trainer asks for none
    kept = torch.tensor([sum(len(st.output_chunks) for st in getattr(strat, "stages", ()))])
    dist.all_reduce(kept, op=dist.ReduceOp.SUM)
    params = full_parameters(model)
    return {
        "losses": losses,
        "params": params,
        "kept_outputs": int(kept),
        "topology": strat.topology.degrees(),
        "held": int(held),
        "seconds": time.perf_counter() - t0,
    }


CASES: dict[int, list[tuple[str, dict[str, Any], int, float | None]]] = {
    2: [
        ("tp", {}, 1, None),
        ("tp", {"sequence_parallel": False}, 1, 0.5),
        ("tp", {"loss_parallel": True}, 2, None),
        ("fsdp+tp", {"tp": 2}, 1, 0.5),
        ("pp", {"pp_schedule": "gpipe"}, 1, None),
        ("pp", {"pp_schedule": "1f1b", "microbatches": 4}, 2, 0.5),
        ("pp", {"pp_schedule": "interleaved-1f1b"}, 1, None),
    ],
    3: [
        ("pp", {"pp_schedule": "1f1b", "microbatches": 4}, 1, 0.5),  # 4 layers on 3 stages: 2, 1, 1
        ("pp", {"pp_schedule": "gpipe", "microbatches": 8}, 1, None),
    ],
    4: [
        ("fsdp+tp", {"tp": 2}, 1, 0.5),  # 2 x 2: tp innermost, FSDP2 over dp_shard
        ("fsdp+tp", {"tp": 2, "shard_accumulated_grads": True}, 2, None),  # a reduce-scatter every micro-step
        ("tp", {"tp": 2}, 1, None),  # 2 replicas of a 2-way TP model
        ("fsdp+pp", {"pp": 2, "pp_schedule": "1f1b"}, 1, 0.5),
        ("fsdp+pp", {"pp": 2, "pp_schedule": "interleaved-1f1b"}, 2, None),
        ("pp", {"pp": 2, "pp_schedule": "gpipe"}, 1, None),  # 2 replicas of a 2-stage pipeline
        ("fsdp+tp+pp", {"tp": 2, "pp": 2, "pp_schedule": "1f1b"}, 1, 0.5),
        ("fsdp+tp+pp", {"tp": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "loss_parallel": True}, 1, None),
    ],
}


def _all_cases(world: int, root: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every case of ``world`` in this process group, then the checkpoint segments the test's process
    continues under ``single``. At 3 ranks: ``pp`` on 3 stages trains 2 steps and saves its stages, with the
    optimizer state flattened (:func:`_flat_state_fns`). At 4 ranks: ``fsdp+tp`` (2 x 2) trains 2 steps and
    saves, ``zero3`` over the same 4 ranks loads it, trains 2 more and saves."""
    results = [_train(name, options, accum, clip) for name, options, accum, clip in CASES[world]]
    if world == 3:
        pipeline = {"pp_schedule": "1f1b", "microbatches": 4}
        return results, [_segment("pp", pipeline, range(0, 2), root, None, True, True)]
    if world != 4:
        return results, []
    a = _segment("fsdp+tp", {"tp": 2}, range(0, 2), root, None, True)
    b = _segment("zero3", {}, range(2, 4), root, a["path"], True)
    return results, [a, b]


def _strategies(world: int) -> list[str]:
    return sorted({name for name, *_ in CASES[world]})


def _world(world: int, *marks: Any) -> Any:
    return pytest.param(world, marks=[pytest.mark.equivalence(*_strategies(world)), *marks])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [_world(2, pytest.mark.slow), _world(3), _world(4)])
def test_model_parallel_matches_single_process(dist_run: Any, world: int, tmp_path: Any) -> None:
    results, segments = dist_run(_all_cases, world, world, str(tmp_path / "ckpt"), timeout_s=290)[0]
    if world == 3:  # the pipeline's checkpoint: each stage saved its own layers; one process loads the union
        _check_pipeline_checkpoint(segments[0], str(tmp_path / "ckpt"))
    elif segments:  # fsdp+tp 2 x 2 -> zero3 x 4 -> single: the uninterrupted run's losses and parameters
        c = _segment("single", {}, range(4, 6), str(tmp_path / "ckpt"), segments[1]["path"], False)
        ref = _reference_long(6)
        got = segments[0]["losses"] + segments[1]["losses"] + c["losses"]
        assert got == pytest.approx(ref["losses"], rel=TOL), "fsdp+tp -> zero3 -> single"
        for name, want in ref["params"].items():
            torch.testing.assert_close(c["params"][name], want, rtol=TOL, atol=2e-5, msg=f"resharded: {name}")
    refs: dict[float | None, dict[str, Any]] = {}
    psi = sum(p.numel() for p in _model().parameters())
    for (name, options, accum, clip), res in zip(CASES[world], results, strict=True):
        ref = refs.setdefault(clip, reference(clip))
        label = f"{name} {options} accum={accum} clip={clip} on {world} ranks ({res['topology']})"
        assert res["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=1e-6), label
        assert list(res["params"]) == list(ref["params"]), label
        worst = 0.0
        for pname, want in ref["params"].items():
            got = res["params"][pname]
            rel = (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()
            worst = max(worst, rel)
            assert rel <= TOL, f"{label}: {pname} differs by {rel:.2e} (relative L2)"
            torch.testing.assert_close(got, want, rtol=TOL, atol=2e-5, msg=f"{label}: {pname}")
        print(f"{label}: {res['seconds']:.1f} s, worst parameter relative L2 error {worst:.1e}")
        # fp32 AdamW: parameters + gradients + 2 moments = 16 bytes per parameter, summed over the ranks
        # that hold a copy: tp/pp/fsdp split it, replicas multiply it
        copies = res["topology"]["dp_replicate"] * (1 if "fsdp" in name else res["topology"]["dp_shard"])
        assert res["held"] == pytest.approx(16 * psi * copies, rel=0.02), label
        assert res["kept_outputs"] == 0, label


# ---- the trainer's path: worker.build_trainer -> parallelize -> Trainer.fit, evaluation included ---------------
LM = [
    "model.name=llama-debug",
    "model.dim=32",
    "model.n_layers=4",
    "model.ffn_hidden=64",
    "data.name=python-stdlib",
    "data.max_bytes=60000",
    "data.seq_len=32",
    "train.steps=3",
    "train.batch_size=8",
    "optimizer.lr=0.01",
    "optimizer.grad_clip=1.0",
]


def _fit(cases: list[list[str]], run_root: str) -> list[dict[str, Any]]:
    """Train each case through the worker's own path; the peak-memory probe is skipped (not under test)."""
    import paratrain.train.trainer as trainer_module
    from tests.dist._reference import train_cases

    trainer_module.measure_peak = lambda fn, *a, **k: (fn(), None)  # type: ignore[attr-defined]
    out = train_cases(cases, run_root)
    return [{"losses": o["losses"], "params": o["params"], "eval_loss": o.get("eval_loss")} for o in out]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_path_pipeline_and_tensor_parallel(dist_run: Any, tmp_path: Any) -> None:
    """``paratrain train``'s worker path (build_trainer, parallelize, Trainer.fit with evaluation) at world 2,
    with activation checkpointing, accumulation and bf16, against the same path with ``single`` here."""
    from tests.dist._reference import train_cases

    single, single_bf16 = train_cases(
        [[*LM, "strategy.name=single"], [*LM, "strategy.name=single", "train.precision=bf16"]],
        str(tmp_path / "single"),
    )
    ac = "train.activation_checkpointing=true"
    cases = [
        [*LM, "strategy.name=pp", "strategy.pp_schedule=interleaved-1f1b", "train.grad_accum=2", ac],
        [*LM, "strategy.name=tp", ac],
        [*LM, "strategy.name=fsdp+tp", "train.precision=bf16"],  # bf16 autocast: a looser match
    ]
    results = dist_run(_fit, 2, cases, str(tmp_path / "dist"), timeout_s=290)[0]
    bf16 = results.pop()
    assert bf16["losses"] == pytest.approx(single_bf16["losses"], rel=2e-2)
    assert bf16["eval_loss"] == pytest.approx(single_bf16["eval_loss"], rel=2e-2)
    for case, res in zip(cases, results, strict=False):
        assert res["losses"] == pytest.approx(single["losses"], rel=TOL), case
        assert res["eval_loss"] == pytest.approx(single["eval_loss"], rel=TOL), case
        for name, want in single["params"].items():
            torch.testing.assert_close(
                res["params"][name], want, rtol=TOL, atol=2e-5, msg=f"{case[-2:]}: {name}"
            )


# ---- checkpoints across layouts ------------------------------------------------------------------------------
def _flat_state_fns() -> Any:
    """DCP state dicts with the optimizer flattened (``param_groups`` options keyed per parameter name):
    pipeline ranks hold different parameter groups, and the nested form keeps one rank's list only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    opts = StateDictOptions(flatten_optimizer_state_dict=True)

    def get(model: nn.Module, optimizer: Any) -> Any:
        return get_state_dict(model, optimizer, options=opts)

    def set_(model: nn.Module, optimizer: Any, model_sd: Any, optim_sd: Any) -> None:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=opts)

    return get, set_


def _segment(
    strategy: str,
    options: dict[str, Any],
    steps: range,
    root: str,
    load: str | None,
    save: bool,
    flat: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` of the global schedule with ``strategy``, after loading ``load`` (a step directory)
    when given, saving at the end when ``save``; the CheckpointManager is the trainer's (``flat``: with the
    optimizer state flattened, :func:`_flat_state_fns`)."""
    from paratrain.checkpoint import CheckpointManager
    from paratrain.data import Batch
    from paratrain.parallel import setup
    from paratrain.runtime import init
    from paratrain.train.precision import Precision
    from paratrain.train.trainer import full_parameters

    ctx = init(seed=None)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, strat = setup(model, opt, strategy=strategy, ctx=ctx, **options)
    manager = CheckpointManager(root, ctx, state_fns=_flat_state_fns() if flat else None)
    if load is not None:
        manager.load(load, model, opt)
    x, y = _tokens()
    n, r = strat.dp_size, strat.dp_rank
    local, losses = BATCH // n, []
    precision = Precision("fp32", torch.device("cpu"))
    for t in steps:
        lo = (t % STEPS) * BATCH + r * local
        opt.zero_grad(set_to_none=True)
        loss = strat.forward_backward(
            model, Batch(x[lo : lo + local], y[lo : lo + local]), _lm_loss, precision, 1
        )
        opt.step()
        if n > 1:
            dist.all_reduce(loss, group=strat.dp_group)
        losses.append(float(loss) / n)
    path = str(manager.save(steps.stop, model, opt, {"strategy": strategy})) if save else None
    return {"losses": losses, "params": full_parameters(model), "path": path}


def _reference_long(steps: int) -> dict[str, Any]:
    """The reference loop over ``steps`` steps, cycling through the STEPS global batches."""
    x, y = _tokens()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for t in range(steps):
        lo = (t % STEPS) * BATCH
        opt.zero_grad()
        loss = _lm_loss(model(x[lo : lo + BATCH]), y[lo : lo + BATCH])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resharding_fsdp_tp_to_zero3_to_single(dist_run: Any, tmp_path: Any) -> None:
    """fsdp+tp (2 x 2) trains 2 steps and saves; zero3 on 2 ranks loads it, trains 2 more and saves; one
    process loads that and trains 2 more: the 6 losses and the final parameters are the uninterrupted run's."""
    root = str(tmp_path / "ckpt")
    a = dist_run(_segment, 4, "fsdp+tp", {"tp": 2}, range(0, 2), root, None, True, timeout_s=290)[0]
    b = dist_run(_segment, 2, "zero3", {}, range(2, 4), root, a["path"], True, timeout_s=290)[0]
    c = _segment("single", {}, range(4, 6), root, b["path"], False)
    ref = _reference_long(6)
    assert a["losses"] + b["losses"] + c["losses"] == pytest.approx(ref["losses"], rel=TOL)
    for name, want in ref["params"].items():
        torch.testing.assert_close(c["params"][name], want, rtol=TOL, atol=2e-5, msg=name)


def _check_pipeline_checkpoint(a: dict[str, Any], root: str) -> None:
    """The pipeline checkpoint of :func:`_all_cases` at 3 ranks holds each stage under the model's original
    parameter names: one process loads the union and continues like the uninterrupted reference.

    With the optimizer state flattened (what checkpoint/ needs for pipelines; the default nested form keeps
    only one rank's ``param_groups[i]["params"]`` list, which does not load)."""
    c = _segment("single", {}, range(2, 4), root, a["path"], False, True)
    ref = _reference_long(4)
    assert a["losses"] + c["losses"] == pytest.approx(ref["losses"], rel=TOL)
    for name, want in ref["params"].items():
        torch.testing.assert_close(c["params"][name], want, rtol=TOL, atol=2e-5, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_single_checkpoint_resumes_as_a_pipeline(dist_run: Any, tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    a = _segment("single", {}, range(0, 2), root, None, True, True)
    b = dist_run(
        _segment, 2, "pp", {"pp_schedule": "interleaved-1f1b"}, range(2, 4), root, a["path"], False, True,
        timeout_s=290,
    )[0]  # fmt: skip
    ref = _reference_long(4)
    assert a["losses"] + b["losses"] == pytest.approx(ref["losses"], rel=TOL)


# ---- a user's own model with its own plan -----------------------------------------------------------------
class _Net(nn.Module):
    """Not a Llama: no built-in plan, so setup(..., tp_plan=...) must be given one."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def _user_plan_run(steps: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from paratrain.data import Batch
    from paratrain.parallel import setup
    from paratrain.runtime import init
    from paratrain.train.precision import Precision
    from paratrain.train.trainer import full_parameters

    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    model, opt, strat = setup(model, opt, strategy="tp", ctx=init(seed=None), tp_plan=plan)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(steps * 8, 16, generator=g), torch.randint(0, 5, (steps * 8,), generator=g)
    losses = []
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        batch = Batch(x[t * 8 : (t + 1) * 8], y[t * 8 : (t + 1) * 8])
        loss = strat.forward_backward(
            model, batch, nn.functional.cross_entropy, Precision("fp32", x.device), 1
        )
        strat.clip_grad_norm(model, 0.5)
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "params": full_parameters(model)}


@pytest.mark.timeout(120)
def test_user_model_with_its_own_tp_plan(dist_run: Any) -> None:
    steps = 4
    got = dist_run(_user_plan_run, 2, steps, timeout_s=110)[0]
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(steps * 8, 16, generator=g), torch.randint(0, 5, (steps * 8,), generator=g)
    losses = []
    for t in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[t * 8 : (t + 1) * 8]), y[t * 8 : (t + 1) * 8])
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    assert got["losses"] == pytest.approx(losses, rel=TOL)
    for name, want in model.named_parameters():
        torch.testing.assert_close(got["params"][name], want.detach(), rtol=TOL, atol=2e-5, msg=name)
