"""FSDP units of Hugging Face models under zero3/hsdp (:func:`paratrain.parallel.fsdp.embedding_units`):
the embedding alone, the final norm with the head, so the root unit holds no parameter (no collective)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.models.hf_arch import decoder_layers
from paratrain.parallel.fsdp import embedding_units, final_norm
from tests._hf_models import config_for

pytestmark = pytest.mark.timeout(60)


def _model(arch: str, **over: object) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_for(arch, **over))


@pytest.mark.parametrize(
    ("arch", "embed", "norm"),
    [("llama", "model.embed_tokens", "model.norm"), ("qwen3", "model.embed_tokens", "model.norm"),
     ("gpt2", "transformer.wte", "transformer.ln_f")],
)  # fmt: skip
def test_untied_models_leave_the_root_without_parameters(arch: str, embed: str, norm: str) -> None:
    model = _model(arch)
    names = {m: n for n, m in model.named_modules()}
    inp, tail = embedding_units(model)
    assert [names[m] for m in inp] == [embed]
    assert [names[m] for m in tail] == [norm, "lm_head"]
    assert final_norm(model) is tail[0]
    units = inp + tail + list(decoder_layers(model))
    in_units = {id(p) for u in units for p in u.parameters()}
    left = [n for n, p in model.named_parameters() if id(p) not in in_units]
    # GPT-2's learned positions stay in the root (used at the start of forward, unlike the tail)
    assert left == (["transformer.wpe.weight"] if arch == "gpt2" else [])


def test_tied_embeddings_stay_in_the_root() -> None:
    assert embedding_units(_model("gpt2", tie_word_embeddings=True)) == ([], [])


def test_a_model_without_embedding_accessors_has_no_embedding_units() -> None:
    assert embedding_units(nn.Sequential(nn.Linear(2, 2))) == ([], [])
