"""The configs of commands that are not a training run (``paratrain generate``): their flags are generated
from these fields (:func:`paratrain.config.add_command_arguments`), as ``train``'s are from :class:`RunConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.config.fields import option
from paratrain.errors import ConfigError

MIN_TEMPERATURE = 1e-6
"""The smallest positive temperature: logits of a few hundred divided by it stay far from float32's range."""


@dataclass(frozen=True)
class GenerateConfig:
    """``paratrain generate``: what to sample from and how."""

    ckpt: str | None = option(None)
    """A run directory, its checkpoints/ directory, or one step_NNNNNNNN."""
    model: str | None = option(None)
    """hf:DIR: sample from a Hugging Face model directory instead of --ckpt."""
    prompt: str = option("")
    """Text the sample continues (empty by default)."""
    max_new_tokens: int = option(200)
    """Tokens to sample."""
    temperature: float = option(0.8)
    """Softmax temperature; 0 = greedy (the most likely token)."""
    top_k: int | None = option(50)
    """Sample among the k most likely tokens (none: among all)."""
    seed: int = option(0)
    """Sampling seed."""
    kv_cache: bool = option(True)
    """Decode with a KV cache; --no-kv-cache recomputes the whole context for every token."""

    def __post_init__(self) -> None:
        if (self.ckpt is None) == (self.model is None):
            raise ConfigError(
                "generate: give --ckpt RUN (a trained run) or --model hf:DIR (a pretrained directory)."
            )
        t = self.temperature
        if (
            self.max_new_tokens < 0
            or not t >= 0
            or math.isinf(t)
            or (self.top_k is not None and self.top_k < 1)
        ):
            raise ConfigError(
                f"--max-new-tokens and --temperature must be >= 0 (a finite number) and --top-k >= 1; got "
                f"{self.max_new_tokens}, {t} and {self.top_k}."
            )
        if 0 < t < MIN_TEMPERATURE:
            raise ConfigError(
                f"--temperature {t:g} is too small: the logits divided by it overflow to infinity. Use 0 "
                f"for greedy sampling (the most likely token), or a value of at least {MIN_TEMPERATURE:g}."
            )
        if not 0 <= self.seed < 2**64:
            raise ConfigError(f"--seed must be an integer from 0 to 2**64 - 1, got {self.seed}.")
