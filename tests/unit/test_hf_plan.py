"""``paratrain plan --model hf:DIR`` (or a config.json): the shape from the JSON alone, without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.errors import ConfigError
from paratrain.plan.hf_config import hf_config_path, shape_from_hf_config


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("arch", "over"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
        ("mistral", {"head_dim": 16}),  # an explicit head_dim (Mistral Nemo): q/o are 4 x 16 wide, not 32
        ("qwen2", {}),  # q/k/v biases
        ("qwen3", {"head_dim": 16, "tie_word_embeddings": True}),  # q/k norms over head_dim
        ("gpt2", {"tie_word_embeddings": True}),
        ("gpt2", {"tie_word_embeddings": False}),
    ],
)
def test_parameter_count_equals_transformers(tmp_path: Path, arch: str, over: dict[str, object]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tests._hf_models import config_for

    cfg = config_for(arch, **over)
    cfg.save_pretrained(str(tmp_path))
    shape = shape_from_hf_config(hf_config_path(f"hf:{tmp_path}"))  # type: ignore[arg-type]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())


LLAMA3_405B = {
    "model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126, "num_attention_heads": 128,
    "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False,
}  # fmt: skip


def test_a_405b_config_plans_without_torch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_405B))
    code = (
        "import sys\n"
        "from paratrain.plan.hf_config import hf_config_path, shape_from_hf_config\n"
        f"shape = shape_from_hf_config(hf_config_path({str(tmp_path / 'config.json')!r}))\n"
        "print(shape.num_params(), 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert 405e9 < int(out[0]) < 406e9  # Llama 3.1 405B: 405.85 B parameters
    assert out[1:] == ["False", "False"]  # no torch, no transformers: the JSON alone
    import argparse

    from paratrain.plan.cli import add_arguments, model_spec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = model_spec(parser.parse_args(["--model", f"hf:{tmp_path}"]))
    assert spec.num_params == int(out[0])


def test_unsupported_or_missing_configs_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ConfigError, match="model_type 't5' is not one the planner models"):
        shape_from_hf_config(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="does not exist"):
        hf_config_path(f"hf:{tmp_path / 'nope'}")
    assert hf_config_path("llama-small") is None


BENCH_LLAMA = {
    "model_type": "llama", "hidden_size": 768, "num_hidden_layers": 4, "num_attention_heads": 12,
    "num_key_value_heads": 12, "intermediate_size": 2048, "vocab_size": 8192, "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_zero3_plans_the_embedding_and_head_as_units_of_their_own(tmp_path: Path, tied: bool) -> None:
    """zero3 wraps an untied HF model's embedding, and its final norm + head, as FSDP units; the root holds
    nothing (parallel/fsdp.embedding_units). Measured on this 41 M model (2 Gloo ranks, batch 4 x 64, fp32):
    394.3 MiB peak per rank, planned 378.4 MiB (0.96); with the embedding and head in the root the plan said
    460 MiB (1.17)."""
    from dataclasses import replace

    from paratrain.config import RunConfig
    from paratrain.plan.api import plan
    from paratrain.plan.guard import run_spec
    from paratrain.plan.hf_config import spec_from_hf_config
    from paratrain.plan.stage import Workload
    from paratrain.spec.hardware import PRESETS

    torch = pytest.importorskip("torch")

    (tmp_path / "config.json").write_text(json.dumps({**BENCH_LLAMA, "tie_word_embeddings": tied}))
    spec = spec_from_hf_config(tmp_path / "config.json", f"hf:{tmp_path}")
    assert spec.embedding_units is not tied
    cpu = replace(PRESETS["cpu-local"], gpus=2, gpus_per_node=2)
    p = plan(spec, cpu, Workload(batch_size=4, seq_len=64), "zero3")["plans"][0]
    terms = p["peak_moment"]["terms"]
    root = terms["fsdp root (params + grads)"]
    assert root >= 8192 * 768 * 4 * 2 if tied else root == 0, terms  # tied: the shared matrix, fp32 p + g
    if not tied:
        assert 0.85 * 394.3 * 2**20 <= p["bytes_per_rank"]["peak"] <= 1.15 * 394.3 * 2**20
    # the launch guard plans the same model (it had only the parameter count of an hf model: states only)
    cfg = RunConfig().override([f"model.name=hf:{tmp_path}"])
    assert run_spec(cfg, None, (64,)) == spec
    if tied:  # a model type the planner has no shape for: the guard plans its parameter count, as before
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt"}))
        assert run_spec(cfg, torch.nn.Linear(3, 2), (64,)).num_params == 8


MIXTRAL_8X7B = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "max_position_embeddings": 32768, "tie_word_embeddings": False,
}  # fmt: skip
"""mistralai/Mixtral-8x7B-v0.1's config.json (the fields the shape reads)."""
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
}  # fmt: skip
"""Qwen/Qwen3-30B-A3B's config.json (as published: ``num_experts``, not transformers 5's ``num_local_experts``)."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("arch", "over"),
    [
        ("mixtral", {}),
        ("qwen2_moe", {}),  # q/k/v biases, a shared expert and its one-output gate
        ("qwen2_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2}),  # experts in layers 1 and 3 only
        ("qwen3_moe", {"mlp_only_layers": [0], "tie_word_embeddings": True}),  # layer 0 dense; q/k norms
    ],
)
def test_mixture_of_experts_configs_count_every_expert(
    tmp_path: Path, arch: str, over: dict[str, object]
) -> None:
    """A Hugging Face MoE config plans with transformers' parameter count (every expert, the routers, the
    shared expert), layer by layer as FSDP wraps it, and only the experts a token is routed to in its FLOPs."""
    import torch
    from transformers import AutoModelForCausalLM

    from paratrain.plan.hf_config import spec_from_hf_config
    from tests._hf_models import config_for

    cfg = config_for(arch, **over)
    cfg.save_pretrained(str(tmp_path))
    spec = spec_from_hf_config(tmp_path / "config.json", f"hf:{tmp_path}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    for layer, group in zip(model.model.layers, spec.layers, strict=True):
        assert group.total == sum(p.numel() for p in layer.parameters())
    moe = spec.moe
    routed = [layer for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert moe is not None and moe.moe_layers == len(routed) and moe.n_experts == 4 and moe.top_k == 2
    idle = sum(p.numel() for layer in routed for p in layer.mlp.experts.parameters()) * (4 - 2) // 4
    assert spec.inactive_params == idle


def test_published_moe_configs_plan_data_parallel_layouts_only(tmp_path: Path) -> None:
    """Mixtral 8x7B and Qwen3-30B-A3B from their config.json: transformers' parameter counts (46.7 B and 30.5 B,
    as published), the data-parallel plans, and the refusals `paratrain train` gives for tensor, pipeline and
    expert parallelism of a transformers MoE model."""
    import argparse

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from paratrain.plan.cli import add_arguments, build

    for name, cfg, billions in (("mixtral", MIXTRAL_8X7B, 46.7), ("qwen3", QWEN3_30B_A3B, 30.5)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(d)))
        n = sum(p.numel() for p in model.parameters())
        assert round(n / 1e9, 1) == billions
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        common = ["--model", f"hf:{d}", "--gpus", "64", "--seq-len", "4096", "--batch-size", "64"]
        out = build(parser.parse_args(common))
        assert out["num_params"] == n
        assert {p["strategy"] for p in out["plans"]} == {"ddp", "zero1", "zero2", "zero3"}
        zero3 = next(p for p in out["plans"] if p["strategy"] == "zero3")
        assert zero3["model_state_bytes_per_rank"] == pytest.approx(
            16 * n / 64, rel=1e-6
        )  # bf16 + fp32 AdamW
        for flags, words in ((["--strategy", "tp", "--tp", "2"], "tensor parallelism"),
                             (["--strategy", "pp", "--pp", "4"], "pipeline parallelism"),
                             (["--strategy", "fsdp+ep", "--ep", "8"], "expert parallelism")):  # fmt: skip
            with pytest.raises(ConfigError, match=words):
                build(parser.parse_args([*common, *flags]))
