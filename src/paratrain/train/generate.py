"""``paratrain generate``: sample text from a trained language-model checkpoint, in one process.

The checkpoint carries the run's config (model preset and overrides, tokenizer, sequence length), so the
model is rebuilt exactly as trained, loaded with its full (unsharded) weights whatever the strategy and
world size that saved it, and sampled token by token: logits of the last position, divided by the
temperature, restricted to the ``top_k`` most likely tokens, then one multinomial draw (``temperature 0``:
the most likely token). The context is cut to the model's ``max_seq_len``.

``--model hf:DIR`` samples from a Hugging Face directory instead (its weights and tokenizer, no checkpoint);
a run that trained an ``hf:`` model is sampled with ``--ckpt`` like any other. For these models the prompt
starts with the model's BOS, and sampling stops after the EOS, as ``transformers``' ``generate`` does, so
``--temperature 0`` gives the tokens of its greedy search.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.inspect import load_full_model, resolve_checkpoint
from paratrain.checkpoint.layout import step_of
from paratrain.checkpoint.state import read_train_state
from paratrain.config import GenerateConfig, RunConfig
from paratrain.data.tokenizers import Tokenizer, load_tokenizer, parse_spec
from paratrain.errors import ConfigError
from paratrain.models import build_model, is_language_model
from paratrain.models.hf import cached_forward
from paratrain.models.llama import Llama
from paratrain.models.llama_decode import forward_cached

SMALL_MODEL = 20_000_000
"""Parameters below which one thread decodes fastest: one token of a small model is a few hundred tiny ops,
whose OpenMP fork/join costs more than it saves (llama-debug on 2 loaded cores: 48 tokens/s on 1 thread,
4.5 on 2)."""


def set_threads(num_params: int) -> int:
    """Set torch's threads as the launcher sets its workers' (``OMP_NUM_THREADS`` wins; else the cores this
    process may use, its CPU affinity), but one for a small model (:data:`SMALL_MODEL`). Returns the count."""
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(1 if num_params < SMALL_MODEL else max(1, cores))
    return torch.get_num_threads()


def _next_logits(model: torch.nn.Module, limit: int, kv_cache: bool) -> Callable[[list[int]], torch.Tensor]:
    """``f(ids) -> logits of the token after ids``. With ``kv_cache``: a prefill, then one position per call
    (:mod:`paratrain.models.llama_decode` for paratrain's Llama, the model's own cache for an hf model), while
    the sequence fits ``limit``; past it, for other models and without a cache, a forward over the last
    ``limit`` ids."""
    cache: list[Any] = []
    done = 0  # ids already in the cache

    def full(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids[-limit:]]))[0, -1].float()

    def cached(ids: list[int]) -> torch.Tensor:
        nonlocal done
        if len(ids) > limit:
            return full(ids)
        new = ids[done:] if done else ids
        logits = forward_cached(model, torch.tensor([new]), cache)  # type: ignore[arg-type]
        done = len(ids)
        return logits[0, -1].float()

    hf_forward = cached_forward(model) if kv_cache else None
    past: Any = None
    # the argument (and output field) that carries the cache: ``cache`` in transformers 5.2x, earlier
    # ``past_key_values``
    cache_arg = (
        "cache" if hf_forward and "cache" in inspect.signature(hf_forward).parameters else "past_key_values"
    )

    def hf_cached(ids: list[int]) -> torch.Tensor:
        nonlocal done, past
        assert hf_forward is not None
        if len(ids) > limit:
            return full(ids)
        new = ids[done:] if done else ids
        out = hf_forward(model, input_ids=torch.tensor([new]), **{cache_arg: past}, use_cache=True)
        past, done = getattr(out, cache_arg), len(ids)
        return out.logits[0, -1].float()

    if hf_forward is not None:
        return hf_cached
    return cached if kv_cache and isinstance(model, Llama) else full


def _tokenizer(cfg: RunConfig, step_dir: Path) -> Tokenizer:
    if cfg.data.tokenizer.startswith("hf:"):
        return load_tokenizer(cfg.data.tokenizer)
    kind, size = parse_spec(cfg.data.tokenizer)
    if kind == "byte":
        return load_tokenizer("byte")
    where = [Path(d) for d in (cfg.data.cache_dir, cfg.train.run_dir, step_dir.parent.parent) if d]
    files = [f for d in where for f in sorted(d.glob(f"tokenizer-bpe{size}-*.json"))]
    if not files:
        raise ConfigError(
            f"the checkpoint was trained with data.tokenizer={cfg.data.tokenizer!r}, but no "
            f"tokenizer-bpe{size}-*.json is in {', '.join(map(str, where))}. Keep the run directory with it."
        )
    return load_tokenizer(cfg.data.tokenizer, files[0])


def _hf_model(name: str, tok_vocab: int) -> torch.nn.Module:
    """``--model hf:DIR``: the directory's model with its own weights (random ones when it has none)."""
    from paratrain.config import ModelConfig
    from paratrain.parallel.parallelize import materialize_deferred
    from paratrain.parallel.strategy import has_meta_parameters

    model = build_model(ModelConfig(name=name), (1,), tok_vocab)
    if has_meta_parameters(model):
        materialize_deferred(model, torch.device("cpu"))
    return model


def _context_limit(model: torch.nn.Module) -> int:
    c = model.config
    for key in ("max_seq_len", "max_position_embeddings", "n_positions"):
        if getattr(c, key, None):
            return int(getattr(c, key))
    return 1 << 30


@torch.no_grad()
def generate(
    ckpt: str | Path | None,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    model_name: str | None = None,
    kv_cache: bool = True,
) -> dict[str, Any]:
    """Sample ``max_new_tokens`` after ``prompt`` from the checkpoint ``ckpt`` or the Hugging Face directory of
    ``model_name`` (``hf:DIR``); returns the text, the new tokens' ids and what produced them. ``kv_cache``:
    decode a paratrain Llama incrementally (the same tokens, far fewer FLOPs; :mod:`paratrain.models.llama_decode`)."""
    # the checks of the command's flags (paratrain.config.commands), for API calls too
    GenerateConfig(None if ckpt is None else str(ckpt), model_name, prompt, max_new_tokens, temperature, top_k,
                   seed, kv_cache)  # fmt: skip
    if model_name is not None:
        return _sample_hf(model_name, prompt, max_new_tokens, temperature, top_k, seed, kv_cache)
    assert ckpt is not None
    step_dir = resolve_checkpoint(ckpt)  # verified (checksums included) before anything is built from it
    state = read_train_state(step_dir, step_of(step_dir))
    cfg = RunConfig.from_dict(state["config"], source=f"{step_dir}/train_state.json")
    if not is_language_model(cfg.model.name):  # before building it: a cnn cannot even take token ids
        raise ConfigError(f"--ckpt {step_dir} holds a {cfg.model.name!r} model, not a language model.")
    tok = _tokenizer(cfg, step_dir)
    try:
        with torch.device("meta"):
            build_model(cfg.model, (cfg.data.seq_len,), tok.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, (cfg.data.seq_len,), tok.vocab_size)
    if any(p.device.type == "meta" for p in model.parameters()):  # an hf: model: weights from the checkpoint
        from paratrain.models.hf_weights import materialize

        materialize(model, torch.device("cpu"))
    if getattr(model, "config", None) is None:
        raise ConfigError(f"--ckpt {step_dir} holds a {cfg.model.name!r} model, not a language model.")
    weights = load_full_model(step_dir, verify=False)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {step_dir} does not match {cfg.model.name}: missing {missing}, unexpected {unexpected}"
        )
    out = _sample(model, tok, prompt, max_new_tokens, temperature, top_k, seed, kv_cache)
    return {"checkpoint": str(step_dir), "step": state.get("step"), "model": cfg.model.name, **out}


def _sample_hf(
    name: str,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    kv_cache: bool = True,
) -> dict[str, Any]:
    from paratrain.data.tokenizers import HFDirTokenizer
    from paratrain.models.hf import HF_PREFIX

    if not name.startswith(HF_PREFIX):
        raise ConfigError(
            f"generate --model {name!r}: write hf:DIR; a paratrain model is sampled with --ckpt RUN."
        )
    tok = HFDirTokenizer(name[len(HF_PREFIX) :])
    model = _hf_model(name, tok.vocab_size)
    out = _sample(model, tok, prompt, max_new_tokens, temperature, top_k, seed, kv_cache)
    return {"checkpoint": None, "step": None, "model": name, **out}


def _sample(
    model: torch.nn.Module,
    tok: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    kv_cache: bool = True,
) -> dict[str, Any]:
    """The sampling loop (module docstring); an hf model's prompt starts with its BOS and it stops at EOS. A
    paratrain Llama or an hf model decodes with a KV cache (``kv_cache``); other models recompute the context
    per token."""
    model.eval()
    set_threads(sum(p.numel() for p in model.parameters()))
    bos, eos = getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)
    ids = ([bos] if bos is not None else []) + tok.encode(prompt)
    ids = ids or [0]
    limit = _context_limit(model)
    gen = torch.Generator().manual_seed(seed)
    out = list(ids)
    cache_used = kv_cache and (isinstance(model, Llama) or cached_forward(model) is not None)
    next_logits = _next_logits(model, limit, cache_used)
    t0 = time.perf_counter()
    for _ in range(max_new_tokens):
        # only ids the tokenizer can decode (a model may have more rows: --set model.vocab_size=)
        logits = next_logits(out)[: tok.vocab_size]
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))
        out.append(nxt)
        if nxt == eos:
            break
    seconds = time.perf_counter() - t0
    new = out[len(ids) :]
    return {
        "prompt": prompt,
        "text": tok.decode(new),
        "new_tokens": len(new),
        "prompt_ids": ids,
        "token_ids": new,
        "tokens_per_s": len(new) / seconds if seconds > 0 else None,
        "kv_cache": cache_used,
        "threads": torch.get_num_threads(),
    }
