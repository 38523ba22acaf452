"""``--model hf:DIR`` under every strategy against an independent single-process ``transformers`` loop.

Each test saves tiny random Hugging Face models (2 layers, sharded into several safetensors files) and, in
the parent process, runs the reference: ``AutoModelForCausalLM.from_pretrained(DIR)`` + ``torch.optim.AdamW``
on the whole global batch, next-token cross-entropy, 4 steps. On every rank, the model is built by
paratrain's registry (parameters on the meta device), split and sharded by ``paratrain.setup``, and each
rank reads its own slices of the files. Checked per case: the logits right after loading equal
``from_pretrained``'s (fp32, max abs 1e-5), the 4 losses and the final parameters (gathered) match the
reference within rel 1e-4, and the names are Hugging Face's. All cases of one world size share one spawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = [pytest.mark.dist]

SEQ, BATCH, STEPS, LR = 16, 8, 4, 1e-2
TOL = 1e-4
LOGIT_TOL = 1e-5


def _tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.empty(BATCH * STEPS, SEQ + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (BATCH * STEPS,), generator=g)
    for i in range(1, SEQ + 1):
        ids[:, i] = (5 * ids[:, i - 1] + 3) % vocab
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())


def reference(d: Path, steps: int = STEPS) -> dict[str, Any]:
    """Plain transformers + AdamW, one process, the global batch per step (cycling through the STEPS
    global batches of :func:`_tokens` beyond STEPS)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="sdpa")
    x, y = _tokens(model.config.vocab_size)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x[:BATCH]).logits
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for t in range(steps):
        lo = (t % STEPS) * BATCH
        opt.zero_grad()
        out = model(input_ids=x[lo : lo + BATCH], use_cache=False).logits
        loss = _lm_loss(out, y[lo : lo + BATCH])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "logits": logits,
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _train(d: str, strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """On every rank: build hf:DIR (meta), setup(strategy) loads this rank's slices, then 4 steps."""
    return _segment(d, strategy, options, range(STEPS), logits=True)


def _segment(
    d: str,
    strategy: str,
    options: dict[str, Any],
    steps: range,
    root: str | None = None,
    load: str | None = None,
    logits: bool = False,
) -> dict[str, Any]:
    """Build hf:DIR (meta), setup(strategy) loads this rank's slices (then the DCP step directory ``load``
    when given), train ``steps`` of the global schedule, save a DCP checkpoint under ``root`` when given."""
    from paratrain.checkpoint import CheckpointManager
    from paratrain.config import ModelConfig
    from paratrain.data import Batch
    from paratrain.models import build_model
    from paratrain.parallel import setup
    from paratrain.runtime import init
    from paratrain.train.precision import Precision
    from paratrain.train.trainer import full_parameters

    model = build_model(ModelConfig(name=f"hf:{d}"), (SEQ,), 1)
    assert all(p.device.type == "meta" for p in model.parameters())
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ctx = init(seed=None)
    model, opt, strat = setup(model, opt, strategy=strategy, ctx=ctx, **options)
    manager = CheckpointManager(root, ctx) if root is not None else None
    if manager is not None and load is not None:
        manager.load(load, model, opt)
    x, y = _tokens(vocab)
    out = None
    if logits:
        model.eval()
        with torch.no_grad():
            out = strat.evaluate_forward(model, x[:BATCH])
        model.train()
    precision = Precision("fp32", torch.device("cpu"))
    n, r = strat.dp_size, strat.dp_rank
    local = BATCH // n
    losses = []
    for t in steps:
        lo = (t % STEPS) * BATCH + r * local
        batch = Batch(x[lo : lo + local], y[lo : lo + local])
        opt.zero_grad(set_to_none=True)
        loss = strat.forward_backward(model, batch, _lm_loss, precision, 1).detach().clone()
        opt.step()
        if n > 1:
            dist.all_reduce(loss, group=strat.dp_group)
        losses.append(float(loss) / n)
    path = None
    if manager is not None and root is not None:
        path = str(manager.save(steps.stop, model, opt, {"strategy": strategy}))
    params = full_parameters(model)
    return {
        "logits": None if out is None else out.detach().clone(),
        "losses": losses,
        "params": params,
        "topology": strat.topology.degrees(),
        "path": path,
    }


def _all_cases(
    cases: list[tuple[str, str, dict[str, Any]]], then: tuple[Any, ...] | None = None
) -> list[dict[str, Any]]:
    """Every case, then (``then``: the arguments of one more :func:`_segment`) a checkpointed segment."""
    out = [_train(d, name, options) for d, name, options in cases]
    return out + ([_segment(*then)] if then is not None else [])


def _check_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    assert list(got) == list(want), label
    # all parameters together within rel 1e-4 (L2); each tensor elementwise (a zero-initialised bias has a
    # tiny norm after 4 Adam steps, so its own relative error is not meaningful: atol covers it)
    diff = torch.cat([(got[k] - v).flatten() for k, v in want.items()])
    whole = torch.cat([v.flatten() for v in want.values()])
    rel = (torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(whole)).item()
    assert rel <= TOL, f"{label}: parameters differ by {rel:.2e} (relative L2)"
    for pname, w in want.items():
        torch.testing.assert_close(got[pname], w, rtol=TOL, atol=5e-5, msg=f"{label}: {pname}")


def _check(cases: list[tuple[str, str, dict[str, Any]]], per_rank: list[list[dict[str, Any]]]) -> None:
    refs: dict[str, dict[str, Any]] = {}
    for i, (d, name, options) in enumerate(cases):
        ref = refs.setdefault(d, reference(Path(d)))
        res = per_rank[0][i]
        label = f"{Path(d).name} {name} {options} ({res['topology']})"
        for rank, rows in enumerate(per_rank):  # every rank that returns logits (pipeline: the last stage)
            got = rows[i]["logits"]
            if got is not None:
                err = (got - ref["logits"]).abs().max().item()
                assert err <= LOGIT_TOL, f"{label}: rank {rank}'s logits after loading differ by {err:.2e}"
        assert res["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=1e-6), label
        _check_params(res["params"], ref["params"], label)


class _Dirs(dict):  # type: ignore[type-arg]
    """Tiny model directories made on first use (``mistral4``: 4 layers, for the interleaved schedule)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        from tests._hf_models import make_hf_dir

        arch, over = (name[:-1], {"num_hidden_layers": 4}) if name.endswith("4") else (name, {})
        self[name] = make_hf_dir(self.root / name, arch, **over)
        return self[name]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: Any) -> dict[str, Path]:
    return _Dirs(tmp_path_factory.mktemp("hf"))


@pytest.mark.timeout(300)
def test_hf_strategies_match_transformers_at_2_ranks(
    dist_run: Any, hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The default tier: ddp, zero3 (Llama and GPT-2), tp (Llama; GPT-2's fused q/k/v; Qwen3's per-head
    norms under fsdp+tp) and pp on Llama, one spawn."""
    llama, gpt2 = str(hf_dirs["llama"]), str(hf_dirs["gpt2"])
    cases = [
        (llama, "ddp", {}),
        (llama, "zero3", {}),
        (gpt2, "zero3", {}),
        (llama, "tp", {}),
        (gpt2, "tp", {}),
        (str(hf_dirs["qwen3"]), "fsdp+tp", {"tp": 2}),
        (llama, "pp", {"pp_schedule": "gpipe"}),
    ]
    # and a checkpoint: GPT-2 under fsdp+tp (tp 2; c_attn whole per rank) trains 2 steps and saves, one process
    # loads it and trains 2 more: the 4-step reference's losses and parameters
    root = str(tmp_path / "ckpt")
    then = (gpt2, "fsdp+tp", {"tp": 2}, range(0, 2), root)
    per_rank = dist_run(_all_cases, 2, cases, then, timeout_s=290)
    _check(cases, [rows[: len(cases)] for rows in per_rank])
    a = per_rank[0][-1]
    b = _segment(gpt2, "single", {}, range(2, 4), root, a["path"])
    ref = reference(Path(gpt2))
    label = "gpt2 fsdp+tp (2 steps) -> single (2 steps)"
    assert a["losses"] + b["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=1e-6), label
    _check_params(b["params"], ref["params"], label)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hf_architectures_match_transformers_at_2_ranks(dist_run: Any, hf_dirs: dict[str, Path]) -> None:
    """zero1/zero2, and tp/fsdp+tp/pp on every architecture that has them."""
    llama, gpt2 = str(hf_dirs["llama"]), str(hf_dirs["gpt2"])
    cases = [
        (llama, "zero2", {}),
        (gpt2, "zero1", {}),
        (str(hf_dirs["qwen2"]), "tp", {"loss_parallel": True}),
        (str(hf_dirs["qwen3"]), "tp", {"loss_parallel": True}),
        (str(hf_dirs["mistral"]), "fsdp+tp", {"tp": 2}),
        (gpt2, "pp", {"pp_schedule": "1f1b", "microbatches": 2}),
        (str(hf_dirs["qwen3"]), "pp", {"pp_schedule": "gpipe"}),
        (str(hf_dirs["mistral4"]), "pp", {"pp_schedule": "interleaved-1f1b"}),
    ]
    per_rank = dist_run(_all_cases, 2, cases, timeout_s=390)
    _check(cases, per_rank)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hf_strategies_match_transformers_at_4_ranks(dist_run: Any, hf_dirs: dict[str, Path]) -> None:
    llama, gpt2 = str(hf_dirs["llama"]), str(hf_dirs["gpt2"])
    cases = [
        (llama, "zero3", {}),
        (llama, "hsdp", {}),
        (gpt2, "ddp", {}),
        (llama, "fsdp+tp", {"tp": 2}),
        (gpt2, "fsdp+tp", {"tp": 2}),
        (str(hf_dirs["qwen2"]), "fsdp+pp", {"pp": 2, "pp_schedule": "1f1b"}),
        (gpt2, "fsdp+pp", {"pp": 2, "pp_schedule": "gpipe"}),
    ]
    per_rank = dist_run(_all_cases, 4, cases, timeout_s=390)
    _check(cases, per_rank)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_resharding_fsdp_tp_to_zero3_to_single(
    dist_run: Any, hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Llama under fsdp+tp (2 x 2) trains 2 steps and saves; zero3 on 2 ranks loads it, trains 2 more and
    saves; one process loads that and trains 2 more: the 6 losses and the final parameters are those of one
    uninterrupted transformers + AdamW process."""
    llama, root = str(hf_dirs["llama"]), str(tmp_path / "ckpt")
    a = dist_run(_segment, 4, llama, "fsdp+tp", {"tp": 2}, range(0, 2), root, timeout_s=290)[0]
    b = dist_run(_segment, 2, llama, "zero3", {}, range(2, 4), root, a["path"], timeout_s=290)[0]
    c = _segment(llama, "single", {}, range(4, 6), root, b["path"])
    ref = reference(Path(llama), 6)
    assert a["losses"] + b["losses"] + c["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=1e-6)
    _check_params(c["params"], ref["params"], "fsdp+tp -> zero3 -> single")
