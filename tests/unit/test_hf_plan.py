"""``paratrain plan --model hf:DIR`` (or a config.json): the shape from the JSON alone, without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    with pytest.raises(ConfigError, match="model_type 't5' is not one the planner reads from the JSON alone"):
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
    if tied:  # another architecture: the guard plans transformers' meta build of it, with its shape
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt", "hidden_size": 64, "ffn_dim": 128,
                                                          "word_embed_proj_dim": 64, "num_hidden_layers": 2,
                                                          "num_attention_heads": 4, "vocab_size": 256}))  # fmt: skip
        opt = run_spec(cfg, torch.nn.Linear(3, 2), (64,))
        assert opt.shape is not None and opt.arch == "OPTForCausalLM" and len(opt.layers) == 2
        # a model type transformers does not know: its parameter count, as before
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model_xyz"}))
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


# Other architectures: transformers builds them on the meta device and the planner reads the parts by place.
# Tiny configs; each names its decoder layers' path in the built model (the test's own way to find them).
OTHER_ARCHS = {
    "gemma2": ({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "num_hidden_layers": 3, "vocab_size": 256}, "model.layers", True),
    "gpt_neox": ({"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "num_hidden_layers": 3,
                  "vocab_size": 256, "tie_word_embeddings": False}, "gpt_neox.layers", False),
    "phi3": ({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
              "num_hidden_layers": 3, "vocab_size": 256, "pad_token_id": 0}, "model.layers", True),
    "starcoder2": ({"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "num_hidden_layers": 3, "vocab_size": 256}, "model.layers", False),
    "olmo2": ({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 3,
               "vocab_size": 256, "pad_token_id": 0}, "model.layers", True),
    "opt": ({"hidden_size": 64, "ffn_dim": 256, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 256,
             "word_embed_proj_dim": 64, "max_position_embeddings": 128}, "model.decoder.layers", False),
}  # fmt: skip


def _meta_model(d: Path) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(d)))


@pytest.mark.parametrize("kind", sorted(OTHER_ARCHS))
def test_other_architectures_are_planned_from_a_meta_build(tmp_path: Path, kind: str) -> None:
    """Gemma 2, GPT-NeoX, Phi-3, StarCoder2, OLMo 2 and OPT: every parameter transformers builds is counted once,
    each decoder layer is a unit of exactly its own parameters, the embedding goes first and the head last, the
    shape is the config's, gated or not as the MLP is; tensor parallelism is refused, as train refuses it."""
    import argparse

    from transformers import AutoConfig

    from paratrain.plan.cli import add_arguments, build
    from paratrain.plan.hf_config import spec_from_hf_config

    over, path, gated = OTHER_ARCHS[kind]
    AutoConfig.for_model(kind, **over).save_pretrained(str(tmp_path))
    spec = spec_from_hf_config(tmp_path / "config.json", f"hf:{tmp_path}")
    model = _meta_model(tmp_path)
    layers: Any = model
    for part in path.split("."):
        layers = getattr(layers, part)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert [g.total for g in spec.layers] == [sum(p.numel() for p in layer.parameters()) for layer in layers]
    embedding = model.get_input_embeddings().weight.numel()
    assert spec.first.total >= embedding
    head = model.get_output_embeddings().weight
    tied = head is model.get_input_embeddings().weight
    assert spec.last.total >= (0 if tied else head.numel())
    assert spec.first.total + sum(g.total for g in spec.layers) + spec.last.total == spec.num_params
    sh = spec.shape
    assert sh is not None and (sh.dim, sh.n_layers, sh.vocab_size) == (64, 3, 256)
    assert sh.n_heads == 4 and sh.gated_mlp is gated and sh.tied_embeddings is tied
    assert spec.embedding_units is not tied and spec.arch == type(model).__name__
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    common = ["--model", f"hf:{tmp_path}", "--gpus", "8", "--seq-len", "128", "--batch-size", "8"]
    zero3 = build(parser.parse_args([*common, "--strategy", "zero3"]))["plans"][0]
    assert zero3["bytes_per_rank"]["activations"] > 0
    assert zero3["model_state_bytes_per_rank"] == pytest.approx(16 * spec.num_params / 8, rel=1e-6)
    with pytest.raises(ConfigError, match=f"not supported for {type(model).__name__}"):
        build(parser.parse_args([*common, "--strategy", "fsdp+tp", "--tp", "2"]))


def test_gemma2_plans_its_soft_capping_norms_and_eager_attention(tmp_path: Path) -> None:
    """Gemma 2 runs eager attention (transformers has no SDPA path for it): the plan says so and keeps the
    scores; its four norms, soft-capped scores and soft-capped logits each add what they keep."""
    import argparse
    from dataclasses import replace

    from transformers import AutoConfig

    from paratrain.plan.cli import add_arguments, build
    from paratrain.plan.hf_config import spec_from_hf_config
    from paratrain.plan.implementation import last_extra, layer, loss_grad

    over = OTHER_ARCHS["gemma2"][0]
    AutoConfig.for_model("gemma2", **over).save_pretrained(str(tmp_path))
    spec = spec_from_hf_config(tmp_path / "config.json", f"hf:{tmp_path}")
    sh = spec.shape
    assert sh is not None and spec.attention == "eager"
    assert (sh.norms, sh.attention_softcap, sh.logit_softcap) == (4, True, True)
    s, b, h, a, v = 128, 2, 64, 4, 256
    plain = replace(sh, norms=2, attention_softcap=False, logit_softcap=False)
    assert (
        layer(sh, s, b, attention="eager") - layer(plain, s, b, attention="eager")
        == 2 * (2 * s * b * h + s * b) * 4 + a * s * s * b * 4
    )
    assert (
        layer(sh, s, b, attention="sdpa") - layer(plain, s, b, attention="sdpa")
        == 2 * (2 * s * b * h + s * b) * 4
    )
    assert last_extra(sh, s, b) - last_extra(plain, s, b) == s * b * v * 4
    assert loss_grad(sh, s, b) == loss_grad(plain, s, b)  # the capping's backward frees as it goes
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = build(parser.parse_args(["--model", f"hf:{tmp_path}", "--gpus", "2", "--seq-len", "128", "--batch-size",
                                   "4", "--strategy", "ddp"]))  # fmt: skip
    assert any("attention eager" in n for n in out["notes"])


def test_mixtures_of_experts_of_other_architectures_are_found_in_the_meta_build(tmp_path: Path) -> None:
    """DeepSeek-V3 (its first layer dense, a shared expert, multi-head latent attention) and OLMoE: the routed
    experts, top-k and shared experts come from the config and the built experts; the parameters a token does
    not run through are the other experts'."""
    from transformers import AutoConfig

    from paratrain.plan.hf_config import spec_from_hf_config

    ds = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "num_hidden_layers": 3,
        "vocab_size": 256,
    }
    olmoe = {"hidden_size": 64, "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
             "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256, "pad_token_id": 0}  # fmt: skip
    for kind, over, moe_layers, shared in (("deepseek_v3", ds, 2, 1.0), ("olmoe", olmoe, 2, 0.0)):
        d = tmp_path / kind
        AutoConfig.for_model(kind, **over).save_pretrained(str(d))
        spec = spec_from_hf_config(d / "config.json", f"hf:{d}")
        model = _meta_model(d)
        moe = spec.moe
        assert moe is not None and (moe.n_experts, moe.top_k, moe.moe_layers) == (8, 2, moe_layers)
        assert moe.moe_hidden == 32 and moe.n_shared_experts == pytest.approx(shared)
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert spec.inactive_params == routed * (8 - 2) // 8
        assert spec.num_params == sum(p.numel() for p in model.parameters())


def test_unknown_and_non_causal_model_types_are_refused(tmp_path: Path) -> None:
    from paratrain.plan.hf_config import spec_from_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model_xyz", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="not one transformers .* knows"):
        spec_from_hf_config(tmp_path / "config.json", "x")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ConfigError, match="could not build a causal LM"):
        spec_from_hf_config(tmp_path / "config.json", "x")


def test_per_head_qk_norms_keep_their_inputs_and_outputs(tmp_path: Path) -> None:
    """Qwen3 (from the JSON) and Gemma 3 (from a meta build) normalise q and k per head: each norm keeps its
    input and output in fp32 and an rstd per head, on the rank's heads; Llama has none."""
    from dataclasses import replace

    from transformers import AutoConfig

    from paratrain.plan.hf_config import spec_from_hf_config
    from paratrain.plan.implementation import layer

    small = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 256}  # fmt: skip
    s, b, t = 64, 2, 2
    for kind, has in (("qwen3", True), ("gemma3_text", True), ("llama", False)):
        d = tmp_path / kind
        AutoConfig.for_model(kind, **small).save_pretrained(str(d))
        sh = spec_from_hf_config(d / "config.json", f"hf:{d}").shape
        assert sh is not None and sh.qk_norms is has, kind
        if has:
            q, kv = 4 * 32, 2 * 32
            for sp in (False, True):  # on the rank's heads: divided by tp once, with or without SP
                extra = layer(sh, s, b, t, sp) - layer(replace(sh, qk_norms=False), s, b, t, sp)
                assert extra == pytest.approx((2 * s * b * (q + kv) + s * b * (4 + 2)) * 4 / t), (kind, sp)


def test_every_causal_lm_transformers_builds_plans_or_is_refused_in_one_line(tmp_path: Path) -> None:
    """A sample of transformers' causal LMs at their default configs (a published config.json's fields): a
    Mamba (no attention heads) is refused naming what is missing; a layer count that names sublayers (LongCat)
    and per-layer attributes without one value (Gemma 4's head_dim) still plan; a vision-language Gemma 3 is
    planned by its language model's layers, not its vision encoder's."""
    from dataclasses import replace

    from transformers import AutoConfig

    from paratrain.plan.api import plan
    from paratrain.plan.hf_config import spec_from_hf_config
    from paratrain.plan.stage import Workload
    from paratrain.spec.hardware import PRESETS

    for kind in ("longcat_flash", "gemma4_text", "falcon", "bloom", "jamba", "gemma3"):
        d = tmp_path / kind
        AutoConfig.for_model(kind, num_hidden_layers=2).save_pretrained(str(d))
        spec = spec_from_hf_config(d / "config.json", kind)
        assert spec.shape is not None and len(spec.layers) == spec.shape.n_layers >= 1, kind
        out = plan(
            spec, replace(PRESETS["h100-nvlink-ib"], gpus=8), Workload(batch_size=8, seq_len=256), "zero3"
        )
        assert out["plans"][0]["bytes_per_rank"]["activations"] > 0, kind
        if (
            kind == "gemma3"
        ):  # the language model's layers (its text config's count), the vision tower before them
            text_layers = AutoConfig.for_model("gemma3").get_text_config().num_hidden_layers
            assert (
                len(spec.layers) == text_layers and spec.first.total > spec.shape.vocab_size * spec.shape.dim
            )
    d = tmp_path / "mamba"
    AutoConfig.for_model("mamba", num_hidden_layers=2).save_pretrained(str(d))
    with pytest.raises(ConfigError, match="no num_attention_heads .*--params N"):
        spec_from_hf_config(d / "config.json", "mamba")
