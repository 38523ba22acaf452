"""``paratrain generate --model hf:DIR``: greedy sampling gives ``transformers``' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_greedy_generate_equals_transformers(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    from paratrain.train.generate import generate
    from tests._hf_models import make_hf_dir

    d = make_hf_dir(tmp_path / arch, arch, seed=7)
    out = generate(None, "the quick brown", 12, 0.0, None, 0, model_name=f"hf:{d}")
    assert out["kv_cache"] is True  # the model's own cache, one position per token after the prompt
    recomputed = generate(None, "the quick brown", 12, 0.0, None, 0, model_name=f"hf:{d}", kv_cache=False)
    assert recomputed["kv_cache"] is False and recomputed["token_ids"] == out["token_ids"]
    assert out["prompt_ids"][0] == 1  # the model's BOS
    ref = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([out["prompt_ids"]]), max_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(out["prompt_ids"]) :].tolist()
    assert out["token_ids"] == want
    assert out["new_tokens"] == len(want) and isinstance(out["text"], str)
