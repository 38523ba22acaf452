"""Registry entries of the text corpora: ``python-stdlib`` and ``text:PATH`` (see :mod:`paratrain.data.text`)."""

from __future__ import annotations

from paratrain.config import DataConfig
from paratrain.data.registry import Splits, register_dataset
from paratrain.data.text import build_text_splits


def _build(source: str, cfg: DataConfig) -> Splits:
    # Text is split by file, and a held-out fraction of 0.2 (the image datasets' default) wastes a fifth of a
    # small corpus: use 0.1 unless it was changed.
    fraction = 0.1 if cfg.test_fraction == 0.2 else cfg.test_fraction
    return build_text_splits(
        source, cfg.path, cfg.tokenizer, cfg.seq_len, cfg.cache_dir, cfg.max_bytes, test_fraction=fraction
    )


@register_dataset("python-stdlib")
def python_stdlib(cfg: DataConfig) -> Splits:
    return _build("python-stdlib", cfg)


@register_dataset("text")
def text(cfg: DataConfig) -> Splits:
    return _build("text", cfg)
