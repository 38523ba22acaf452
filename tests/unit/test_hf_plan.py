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
