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
EPS = 1e-6
"""AdamW's eps, on both sides. At torch's 1e-8 an element whose gradient is near zero moves by up to a whole
``lr * sign(g)``, and the fp32 rounding of another reduction order decides that sign: one element of Qwen2-MoE's
embedding (row 27) ended 4.6e-4 apart under ddp, zero3 and hsdp, while the logits after loading, the losses
and every other element agreed."""
LOGIT_TOL = 1e-5
_BIG = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 8, "vocab_size": 2048}
"""The load-memory model: 14.6 M parameters (55.5 MiB fp32), each decoder layer 1.6 M (6.2 MiB)."""
SLACK = 6 * 2**20
"""Memory a load may take beyond its shard and one block: DCP's read plan, Python objects, allocator slack."""


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
    from tests._hf_models import load_reference

    model = load_reference(d)
    x, y = _tokens(model.config.vocab_size)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x[:BATCH]).logits
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
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
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
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
    cases: list[tuple[str, str, dict[str, Any]]],
    then: tuple[Any, ...] | None = None,
    peak_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Every case, then (``then``: the arguments of one more :func:`_segment`) a checkpointed segment, then
    (``peak_dir``) the memory of a zero3 load."""
    out = [_train(d, name, options) for d, name, options in cases]
    out += [_segment(*then)] if then is not None else []
    return out + ([_load_peak(peak_dir)] if peak_dir is not None else [])


def _rss_anon() -> int:
    """This process's resident anonymous memory in bytes (heap and anonymous mappings, not the page cache
    of memory-mapped files), from ``/proc/self/status``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def _load_peak(d: str) -> dict[str, Any]:
    """Build hf:DIR on the meta device and set it up under zero3 (which allocates this rank's shard and reads
    it from the files), sampling the resident memory each time DCP commits a slice it read (the shard written
    so far plus the slice still alive) and once after."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from paratrain.config import ModelConfig
    from paratrain.models import build_model
    from paratrain.models.hf import decoder_layers
    from paratrain.parallel import setup
    from paratrain.runtime import init

    model = build_model(ModelConfig(name=f"hf:{d}"), (SEQ,), 1)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() * p.element_size() for p in decoder_layers(model)[0].parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # no optimizer state: only the weights are allocated
    ctx = init(seed=None)
    samples: list[int] = []
    commit = DefaultLoadPlanner.commit_tensor

    def sampling_commit(self: Any, read_item: Any, tensor: torch.Tensor) -> None:
        samples.append(_rss_anon())
        commit(self, read_item, tensor)

    base = _rss_anon()
    DefaultLoadPlanner.commit_tensor = sampling_commit  # type: ignore[method-assign]
    try:
        model, opt, _ = setup(model, opt, strategy="zero3", ctx=ctx)
    finally:
        DefaultLoadPlanner.commit_tensor = commit  # type: ignore[method-assign]
    samples.append(_rss_anon())
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())  # type: ignore[operator]
    return {"base": base, "peak": max(samples), "reads": len(samples) - 1, "shard": shard, "full": full,
            "block": block, "largest": largest}  # fmt: skip


def _check_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    assert list(got) == list(want), label
    # all parameters together within rel 1e-4 (L2); each tensor elementwise (a zero-initialised bias has a
    # tiny norm after 4 Adam steps, so its own relative error is not meaningful: atol covers it)
    diff = torch.cat([(got[k] - v).flatten() for k, v in want.items()])
    whole = torch.cat([v.flatten() for v in want.values()])
    rel = (torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(whole)).item()
    assert rel <= TOL, f"{label}: parameters differ by {rel:.2e} (relative L2)"
    for pname, w in want.items():
        torch.testing.assert_close(got[pname], w, rtol=TOL, atol=5e-5, msg=lambda m: f"{label}: {pname}: {m}")


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
    """Tiny model directories made on first use (``mistral4``: 4 layers, for the interleaved schedule;
    ``gpt2_tied``: the embedding and the head tied)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        from tests._hf_models import make_hf_dir

        arch, over = name, {}
        if arch.endswith("_tied"):  # one matrix for the input embedding and the head
            arch, over = arch[: -len("_tied")], {"tie_word_embeddings": True}
        if arch.endswith("4"):
            arch, over = arch[:-1], {**over, "num_hidden_layers": 4}
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
    norms under fsdp+tp), pp on Llama and on a tied GPT-2, Mixtral under zero3 and Qwen3-MoE under ddp read
    from their per-expert files, Gemma 2 under zero3 and GPT-NeoX under zero2, one spawn."""
    llama, gpt2 = str(hf_dirs["llama"]), str(hf_dirs["gpt2"])
    cases = [
        (llama, "ddp", {}),
        (llama, "zero3", {}),
        (gpt2, "zero3", {}),
        (llama, "tp", {}),
        (gpt2, "tp", {}),
        (str(hf_dirs["qwen3"]), "fsdp+tp", {"tp": 2}),
        (llama, "pp", {"pp_schedule": "gpipe"}),
        # tied: the first and the last stage's ranks each hold the matrix and sum its two gradients
        (str(hf_dirs["gpt2_tied"]), "pp", {"pp_schedule": "1f1b", "microbatches": 2}),
        # mixtures of experts, stored as save_pretrained writes them (each expert's w1/w2/w3 or gate/up/down
        # matrices, which transformers stacks into one gate_up_proj and one down_proj per layer on load)
        (str(hf_dirs["mixtral"]), "zero3", {}),
        (str(hf_dirs["qwen3_moe"]), "ddp", {}),
        # architectures without a tensor-parallel plan: Gemma 2 (eager attention: no SDPA path in
        # transformers) and GPT-NeoX (an ungated MLP, a parallel residual)
        (str(hf_dirs["gemma2"]), "zero3", {}),
        (str(hf_dirs["gpt_neox"]), "zero2", {}),
    ]
    # and a checkpoint: GPT-2 under fsdp+tp (tp 2; c_attn whole per rank) trains 2 steps and saves, one process
    # loads it and trains 2 more: the 4-step reference's losses and parameters
    from tests._hf_models import make_hf_dir

    root = str(tmp_path / "ckpt")
    then = (gpt2, "fsdp+tp", {"tp": 2}, range(0, 2), root)
    # and the memory of a sharded load: a 55.5 MiB Llama (8 layers of 6.2 MiB) under zero3 on 2 ranks
    big = make_hf_dir(tmp_path / "big", "llama", shard="20MB", **_BIG)
    per_rank = dist_run(_all_cases, 2, cases, then, str(big), timeout_s=290)
    _check(cases, [rows[: len(cases)] for rows in per_rank])
    for rank, rows in enumerate(per_rank):
        m = rows[-1]
        grew, bound = m["peak"] - m["base"], m["shard"] + max(m["block"], m["largest"]) + SLACK
        assert m["reads"] > 0 and m["shard"] * 2 == m["full"], m
        # the bound is under the whole model, so a rank that materialised it would fail
        assert bound < m["full"] and m["shard"] * 0.9 <= grew <= bound, (
            f"rank {rank}: a zero3 load grew the resident memory by {grew / 2**20:.1f} MiB; its shard is "
            f"{m['shard'] / 2**20:.1f} MiB, one decoder layer {m['block'] / 2**20:.1f} MiB, the model "
            f"{m['full'] / 2**20:.1f} MiB"
        )
    a = per_rank[0][-2]
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
        # tied, interleaved: the matrix is on rank 0's first and rank 1's last virtual stage
        (str(hf_dirs["llama4_tied"]), "pp", {"pp_schedule": "interleaved-1f1b"}),
        (str(hf_dirs["mixtral"]), "zero2", {}),
        (str(hf_dirs["qwen2_moe"]), "ddp", {}),
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
        (str(hf_dirs["llama_tied"]), "fsdp+pp", {"pp": 2, "pp_schedule": "1f1b"}),
        (str(hf_dirs["llama_tied"]), "fsdp+tp+pp", {"tp": 2, "pp": 2, "pp_schedule": "1f1b"}),
        (str(hf_dirs["qwen2_moe"]), "hsdp", {}),  # with Qwen2-MoE's shared expert and its gate
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
