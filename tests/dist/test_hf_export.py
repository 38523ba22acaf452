"""``paratrain ckpt export --format hf``: checkpoints out as Hugging Face directories, and back in.

- an ``hf:`` run trained under a sharded layout, exported: ``from_pretrained(OUT)`` loads with no missing
  or unexpected keys and gives the logits of paratrain's trained model (fp32, 1e-5);
- paratrain's ``llama-debug`` exported as a ``LlamaForCausalLM`` (names mapped, rotary rows permuted):
  the same logits as paratrain's model; ``--init-from hf:OUT`` loads it back into paratrain's Llama exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist._reference import train_cases

pytestmark = [pytest.mark.dist]


def _from_pretrained(out: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _paratrain_hf_logits(src: Path, params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """paratrain's model of ``hf:src`` holding the trained ``params``."""
    from paratrain.config import ModelConfig
    from paratrain.models import build_model
    from paratrain.parallel.parallelize import materialize_deferred

    model = build_model(ModelConfig(name=f"hf:{src}"), (ids.shape[1],), 1)
    materialize_deferred(model, torch.device("cpu"))
    model.load_state_dict(params, strict=False)  # a tied head is the embedding
    model.eval()
    with torch.no_grad():
        return model(ids)


def _case(src: Path, corpus: Path, *extra: str) -> list[str]:
    return [
        f"model.name=hf:{src}", "data.name=text", f"data.path={corpus}", f"data.tokenizer=hf:{src}",
        "data.seq_len=16", "train.steps=3", "train.batch_size=4", "optimizer.lr=0.01",
        "checkpoint.save_at_end=true", *extra,
    ]  # fmt: skip


def _check_export(run: Path, src: Path, params: dict[str, torch.Tensor], tmp: Path) -> None:
    from paratrain.checkpoint.export_hf import export_hf

    step = next((run / "case0" / "checkpoints").glob("step_*"))
    info = export_hf(step, tmp / "out", max_shard="40KB")
    assert info["files"] > 1 and (tmp / "out" / "model.safetensors.index.json").is_file()
    assert (tmp / "out" / "tokenizer.json").is_file()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = _from_pretrained(tmp / "out")(input_ids=ids).logits
    want = _paratrain_hf_logits(src, params, ids)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.timeout(300)
def test_hf_run_exported_loads_with_from_pretrained(tmp_path: Path) -> None:
    """One process (the default tier); the sharded layouts are the slow tests below."""
    from tests._hf_models import TEXT, make_hf_dir

    src = make_hf_dir(tmp_path / "gpt2", "gpt2")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 10)
    res = train_cases([_case(src, corpus, "strategy.name=single")], str(tmp_path / "run"))[0]
    _check_export(tmp_path / "run", src, res["params"], tmp_path)


@pytest.mark.timeout(300)
def test_moe_run_exported_in_the_layout_save_pretrained_writes(tmp_path: Path) -> None:
    """A Mixtral run (one process) exported: every expert's matrices under the names save_pretrained writes (the
    source directory's), loaded by from_pretrained with no missing or unexpected keys, with the trained logits."""
    from paratrain.models.hf_weights import checkpoint_keys
    from tests._hf_models import TEXT, make_hf_dir

    src = make_hf_dir(tmp_path / "mixtral", "mixtral")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 10)
    res = train_cases([_case(src, corpus, "strategy.name=single")], str(tmp_path / "run"))[0]
    _check_export(tmp_path / "run", src, res["params"], tmp_path)
    stored = checkpoint_keys(tmp_path / "out")
    assert stored == checkpoint_keys(src) and "model.layers.0.block_sparse_moe.experts.3.w2.weight" in stored


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_run_exported_from_zero3_loads_with_from_pretrained(dist_run: Any, tmp_path: Path) -> None:
    from tests._hf_models import TEXT, make_hf_dir

    src = make_hf_dir(tmp_path / "gpt2", "gpt2")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 10)
    res = dist_run(train_cases, 2, [_case(src, corpus, "strategy.name=zero3")], str(tmp_path / "run"))[0][0]
    _check_export(tmp_path / "run", src, res["params"], tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hf_run_exported_from_fsdp_tp_2x2(dist_run: Any, tmp_path: Path) -> None:
    from tests._hf_models import TEXT, make_hf_dir

    src = make_hf_dir(tmp_path / "llama", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 10)
    case = _case(src, corpus, "strategy.name=fsdp+tp", "strategy.tp=2", "train.batch_size=8")
    res = dist_run(train_cases, 4, [case], str(tmp_path / "run"), timeout_s=390)[0][0]
    _check_export(tmp_path / "run", src, res["params"], tmp_path)


@pytest.mark.timeout(300)
def test_paratrain_llama_exports_to_llama_for_causal_lm_and_back(tmp_path: Path) -> None:
    from paratrain.checkpoint.export_hf import export_hf
    from paratrain.checkpoint.inspect import load_full_model
    from paratrain.config import ModelConfig
    from paratrain.models import build_model
    from tests._hf_models import TEXT

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 10)
    shape = ["model.name=llama-debug", "model.dim=32", "model.n_layers=2", "model.n_heads=4",
             "model.n_kv_heads=2", "model.ffn_hidden=64"]  # fmt: skip
    train_cases([[*shape, "data.name=text", f"data.path={corpus}", "data.seq_len=16", "train.steps=2",
                  "train.batch_size=4", "checkpoint.save_at_end=true"]], str(tmp_path / "run"))  # fmt: skip
    step = next((tmp_path / "run" / "case0" / "checkpoints").glob("step_*"))
    export_hf(step, tmp_path / "out")
    trained = load_full_model(step)
    cfg = ModelConfig(name="llama-debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    ours = build_model(cfg, (16,), 256)
    ours.load_state_dict(trained)
    ours.eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ours(ids)
        got = _from_pretrained(tmp_path / "out")(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    # and back: --init-from hf:OUT gives paratrain's Llama the trained tensors, bit for bit
    cfg.init_from = f"hf:{tmp_path / 'out'}"
    back = build_model(cfg, (16,), 256)
    for name, t in back.named_parameters():
        assert torch.equal(t, trained[name]), name
