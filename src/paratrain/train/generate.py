"""``paratrain generate``: sample text from a trained language-model checkpoint, in one process.

The checkpoint carries the run's config (model preset and overrides, tokenizer, sequence length), so the
model is rebuilt exactly as trained, loaded with its full (unsharded) weights whatever the strategy and
world size that saved it, and sampled token by token: logits of the last position, divided by the
temperature, restricted to the ``top_k`` most likely tokens, then one multinomial draw (``temperature 0``:
the most likely token). The context is cut to the model's ``max_seq_len``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.inspect import load_full_model, resolve_checkpoint
from paratrain.checkpoint.layout import step_of
from paratrain.checkpoint.state import read_train_state
from paratrain.config import RunConfig
from paratrain.data.tokenizers import Tokenizer, load_tokenizer, parse_spec
from paratrain.errors import ConfigError
from paratrain.models import build_model, is_language_model

MIN_TEMPERATURE = 1e-6
"""The smallest positive temperature: logits of a few hundred divided by it stay far from float32's range."""


def _tokenizer(cfg: RunConfig, step_dir: Path) -> Tokenizer:
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


@torch.no_grad()
def generate(
    ckpt: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> dict[str, Any]:
    """Sample ``max_new_tokens`` after ``prompt``; returns the text and what produced it."""
    if (
        max_new_tokens < 0
        or not temperature >= 0
        or math.isinf(temperature)
        or (top_k is not None and top_k < 1)
    ):
        raise ConfigError(
            f"--max-new-tokens and --temperature must be >= 0 (a finite number) and --top-k >= 1; got "
            f"{max_new_tokens}, {temperature} and {top_k}."
        )
    if 0 < temperature < MIN_TEMPERATURE:
        raise ConfigError(
            f"--temperature {temperature:g} is too small: the logits divided by it overflow to infinity. Use 0 "
            f"for greedy sampling (the most likely token), or a value of at least {MIN_TEMPERATURE:g}."
        )
    if not 0 <= seed < 2**64:
        raise ConfigError(f"--seed must be an integer from 0 to 2**64 - 1, got {seed}.")
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
    if getattr(model, "config", None) is None:
        raise ConfigError(f"--ckpt {step_dir} holds a {cfg.model.name!r} model, not a language model.")
    weights = load_full_model(step_dir, verify=False)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {step_dir} does not match {cfg.model.name}: missing {missing}, unexpected {unexpected}"
        )
    model.eval()
    ids = tok.encode(prompt) or [0]
    limit = int(getattr(model, "config").max_seq_len)  # noqa: B009  (nn.Module attributes are typed loosely)
    gen = torch.Generator().manual_seed(seed)
    out = list(ids)
    t0 = time.perf_counter()
    for _ in range(max_new_tokens):
        # only ids the tokenizer can decode (a model may have more rows: --set model.vocab_size=)
        logits = model(torch.tensor([out[-limit:]]))[0, -1].float()[: tok.vocab_size]
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))
        out.append(nxt)
    seconds = time.perf_counter() - t0
    return {
        "checkpoint": str(step_dir),
        "step": state.get("step"),
        "model": cfg.model.name,
        "prompt": prompt,
        "text": tok.decode(out[len(ids) :]),
        "new_tokens": max_new_tokens,
        "tokens_per_s": max_new_tokens / seconds if seconds > 0 else None,
    }
