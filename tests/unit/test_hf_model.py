"""The ``hf:`` model in one process: meta build, loading, activation checkpointing of the decoder layers,
the FLOPs of its spec."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.mark.timeout(300)
def test_meta_build_loads_and_checkpoints_the_decoder_layers(tmp_path: Path) -> None:
    from paratrain.config import ModelConfig
    from paratrain.models import build_model
    from paratrain.models.spec import spec_of
    from paratrain.parallel.parallelize import apply_activation_checkpointing, materialize_deferred
    from tests._hf_models import make_hf_dir, reference_logits

    d = make_hf_dir(tmp_path / "llama", "llama")
    model = build_model(ModelConfig(name=f"hf:{d}"), (16,), 96)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.device.type == "cpu"  # computed buffers are real
    spec = spec_of(model)
    assert spec is not None and spec.family == "hf:LlamaForCausalLM"
    # FLOPs: 6 N (N without the input embedding) + 12 L H Q T
    n = sum(p.numel() for p in model.parameters()) - 96 * 32
    assert spec.flops_per_token is not None
    assert spec.flops_per_token(model, 16) == 6 * n + 12 * 2 * 4 * 8 * 16
    materialize_deferred(model, torch.device("cpu"))
    assert apply_activation_checkpointing(model) == 2
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    out = model(ids)
    out.float().sum().backward()
    assert (out.detach() - reference_logits(d, ids)).abs().max().item() <= 1e-5
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.timeout(300)
def test_sequences_longer_than_gpt2_positions_are_refused(tmp_path: Path) -> None:
    from paratrain.config import ModelConfig
    from paratrain.errors import ConfigError
    from paratrain.launch.train_job import check_language_model
    from paratrain.models import build_model
    from tests._hf_models import make_hf_dir

    d = make_hf_dir(tmp_path / "gpt2", "gpt2")  # n_positions=128
    with torch.device("meta"):
        model = build_model(ModelConfig(name=f"hf:{d}"), (256,), 96)
    check_language_model(f"hf:{d}", model, (128,))
    with pytest.raises(ConfigError, match="exceeds the 128 learned positions"):
        check_language_model(f"hf:{d}", model, (256,))


@pytest.mark.timeout(300)
def test_meta_build_computes_buffers_the_model_initialises(tmp_path: Path) -> None:
    """Gemma's embedding scale is a computed buffer of a module without a config: the model's own
    ``_init_weights`` sets it on the CPU, so the loaded model gives ``from_pretrained``'s logits."""
    from paratrain.config import ModelConfig
    from paratrain.models import build_model
    from paratrain.models.hf_weights import materialize_and_load
    from tests._hf_models import make_hf_dir, reference_logits

    d = make_hf_dir(tmp_path / "gemma", "gemma")
    model = build_model(ModelConfig(name=f"hf:{d}"), (16,), 96)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    materialize_and_load(model, torch.device("cpu"))
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids) - reference_logits(d, ids)).abs().max().item() <= 1e-5


def test_tokenizer_files_without_tokenizer_json_are_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory with only a slow tokenizer (tokenizer.model) falls back to bytes, and says so."""
    from types import SimpleNamespace

    from paratrain.launch.train_job import use_model_tokenizer

    (tmp_path / "tokenizer.model").write_bytes(b"")
    cfg = SimpleNamespace(
        model=SimpleNamespace(name=f"hf:{tmp_path}"), data=SimpleNamespace(tokenizer="byte")
    )
    use_model_tokenizer(cfg)  # type: ignore[arg-type]
    assert cfg.data.tokenizer == "byte" and "no tokenizer.json" in capsys.readouterr().err
    (tmp_path / "tokenizer.json").write_text("{}")
    use_model_tokenizer(cfg)  # type: ignore[arg-type]
    assert cfg.data.tokenizer == f"hf:{tmp_path}"
