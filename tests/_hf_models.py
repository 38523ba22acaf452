"""Tiny random Hugging Face model directories for the tests (nothing downloaded).

:func:`make_hf_dir` builds a 2-layer model of one architecture from its ``transformers`` config, saves it
sharded into several safetensors files (``max_shard_size`` small) with its index, and a byte-level BPE
tokenizer trained with ``tokenizers`` on a few lines of text (``tokenizer.json`` + ``tokenizer_config.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 96
TEXT = (
    "the quick brown fox jumps over the lazy dog. " * 3
    + "a stitch in time saves nine. all that glitters is not gold. " * 3
    + "def add(a, b):\n    return a + b\n" * 4
)


def config_for(arch: str, **over: Any) -> Any:
    """A 2-layer, width-32 config of ``arch`` (llama, qwen2, qwen3, mistral, gpt2, opt, gemma, gemma2, gpt_neox;
    the mixtures of experts mixtral, qwen2_moe, qwen3_moe); dropout off."""
    import transformers as tf

    common = {"vocab_size": VOCAB, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    if arch == "opt":  # an architecture without a tensor-parallel plan in paratrain
        kw = {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "max_position_embeddings": 128, "word_embed_proj_dim": 32, "dropout": 0.0, **common}  # fmt: skip
        kw.update(over)
        return tf.OPTConfig(**kw)
    if arch == "gemma":  # no tensor-parallel plan; a computed embedding-scale buffer without a config
        kw = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128, "pad_token_id": 0,
              **common}  # fmt: skip
        kw.update(over)
        return tf.GemmaConfig(**kw)
    if arch == "gemma2":  # no SDPA path in transformers: eager attention, soft-capped scores, 4 norms a layer
        kw = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128, "sliding_window": 16,
              "pad_token_id": 0, **common}  # fmt: skip
        kw.update(over)
        return tf.Gemma2Config(**kw)
    if arch == "gpt_neox":  # an ungated MLP, LayerNorms with biases, partial rotary, parallel residual
        kw = {"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "max_position_embeddings": 128, "rotary_pct": 0.25, "hidden_dropout": 0.0, "attention_dropout": 0.0,
              **common}  # fmt: skip
        kw.update(over)
        return tf.GPTNeoXConfig(**kw)
    if arch == "gpt2":
        kw = {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128, "resid_pdrop": 0.0,
              "embd_pdrop": 0.0, "attn_pdrop": 0.0, **common}  # fmt: skip
        kw.update(over)
        return tf.GPT2Config(**kw)
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):  # mixtures of experts: 4 experts, top 2, in every layer
        kw = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 128, "num_experts_per_tok": 2, **common}  # fmt: skip
        if arch == "mixtral":
            kw.update(num_local_experts=4, router_jitter_noise=0.0)
        else:
            kw.update(num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
        if arch == "qwen2_moe":
            kw.update(shared_expert_intermediate_size=48)
        if arch == "qwen3_moe":
            kw["head_dim"] = 8
        kw.update(over)
        return {"mixtral": tf.MixtralConfig, "qwen2_moe": tf.Qwen2MoeConfig, "qwen3_moe": tf.Qwen3MoeConfig}[
            arch
        ](**kw)
    cls = {
        "llama": tf.LlamaConfig,
        "qwen2": tf.Qwen2Config,
        "qwen3": tf.Qwen3Config,
        "mistral": tf.MistralConfig,
    }
    kw = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 128, **common}  # fmt: skip
    if arch == "qwen3":
        kw["head_dim"] = 8
    kw.update(over)
    return cls[arch](**kw)


def train_tokenizer(vocab: int = VOCAB) -> Any:
    """A byte-level BPE of at most ``vocab`` ids with ``<pad>``, ``<s>`` (1) and ``</s>`` (2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60],
    )  # fmt: skip
    tok.train_from_iterator([TEXT], trainer)
    return tok


def make_hf_dir(path: Path, arch: str = "llama", seed: int = 0, shard: str = "20KB", **over: Any) -> Path:
    """Save a random tiny ``arch`` model (sharded) and a tokenizer under ``path``; returns ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_for(arch, **over))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), max_shard_size=shard)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(), bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(path))
    return path


def load_reference(path: Path) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path)`` in fp32 with SDPA, or with eager attention for an
    architecture transformers builds without SDPA (Gemma 2)."""
    import torch
    from transformers import AutoModelForCausalLM

    for attention in ("sdpa", "eager"):
        try:
            return AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.float32, attn_implementation=attention
            )
        except ValueError:
            if attention == "eager":
                raise
    raise AssertionError("unreachable")


def reference_logits(path: Path, ids: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path)``'s logits for ``ids`` (fp32)."""
    import torch

    m = load_reference(path)
    m.eval()
    with torch.no_grad():
        return m(input_ids=ids).logits
