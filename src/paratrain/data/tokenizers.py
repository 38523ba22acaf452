"""Tokenizers for the text datasets: bytes by default, or a BPE trained on the training split.

A tokenizer is named by a spec string (``data.tokenizer``):

- ``byte`` (the default): the UTF-8 bytes of the text, vocabulary 256. Nothing to train or store, and
  ``decode(encode(text)) == text`` for every string.
- ``bpe:N``: a byte-level BPE with ``N`` token ids (Sennrich et al. 2016, https://arxiv.org/abs/1508.07909;
  the byte-level variant of GPT-2), trained with Hugging Face ``tokenizers`` on the training split only, so
  no validation text leaks into the vocabulary. The 256 byte symbols are always in the vocabulary, so any
  text encodes without an unknown token and decodes back exactly. A small corpus may run out of pairs to
  merge before ``N``; the ids above the learned ones are then unused.
- ``hf:DIR``: a Hugging Face model's own tokenizer, ``DIR/tokenizer.json`` (read with ``tokenizers``), with the
  model's BOS and EOS ids (``tokenizer_config.json``'s ``bos_token``/``eos_token``, else ``config.json``'s
  ``bos_token_id``/``eos_token_id``). ``--model hf:DIR`` picks it when ``data.tokenizer`` is left unset.
  Each document is encoded as ``BOS + text + EOS`` (whichever of the two the model has).

A trained BPE is written to ``CACHE_DIR/tokenizer-bpeN-HASH.json`` (the run directory), where ``HASH`` is a
digest of the spec and of the training text; a later run with the same corpus and vocabulary size loads
that file instead of training again. The file is written under a temporary name and renamed, so ranks that
train at the same time (they produce the same file) never read a half-written one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "HFDirTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "cache_path",
    "load_tokenizer",
    "parse_spec",
]

_CACHE_FORMAT = 1  # bump when the training recipe below changes, so old cache files are not reused


class Tokenizer(ABC):
    """Text to token ids and back."""

    spec: str
    """The spec string that names this tokenizer (``byte``, ``bpe:4096``)."""
    vocab_size: int
    """Every id is in ``[0, vocab_size)``: the model's embedding and output size."""

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int] | torch.Tensor) -> str: ...

    def encode_documents(self, docs: Sequence[str], separator: str) -> torch.Tensor:
        """One int64 stream: the tokens of each document followed by the tokens of ``separator``."""
        sep = self.encode(separator)
        parts = [torch.tensor(self.encode(doc) + sep, dtype=torch.int64) for doc in docs]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


class ByteTokenizer(Tokenizer):
    """Token id = byte value of the UTF-8 encoding."""

    spec = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        # A slice of a stream may start or end inside a multi-byte character: show U+FFFD, never fail.
        return bytes(values).decode("utf-8", errors="replace")

    def encode_documents(self, docs: Sequence[str], separator: str) -> torch.Tensor:
        # One bytes object and one buffer view: no Python int per byte (the stdlib corpus is ~12 MB).
        data = bytearray(separator.join(docs).encode("utf-8"))
        if docs:
            data += separator.encode("utf-8")
        return (
            torch.frombuffer(data, dtype=torch.uint8).to(torch.int64)
            if data
            else torch.empty(0, dtype=torch.int64)
        )


class BPETokenizer(Tokenizer):
    """A byte-level BPE held by a Hugging Face ``tokenizers.Tokenizer``."""

    def __init__(self, hf_tokenizer: HFTokenizer, vocab_size: int) -> None:
        self._tok = hf_tokenizer
        self.vocab_size = vocab_size
        self.spec = f"bpe:{vocab_size}"
        self.path: Path | None = None
        """The JSON file this tokenizer was loaded from or saved to (None: in memory only)."""

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int) -> BPETokenizer:
        """Learn merges on ``texts`` until the vocabulary has ``vocab_size`` ids (or no pair is left)."""
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = tokenizers.Tokenizer(models.BPE())
        # GPT-2's byte-level pre-tokenizer: text is split on its regex, each piece mapped byte by byte to
        # 256 printable symbols; merges never cross a piece boundary.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[],
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
        return cls(tok, vocab_size)

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int) -> BPETokenizer:
        import tokenizers

        tok = cls(tokenizers.Tokenizer.from_file(str(path)), vocab_size)
        tok.path = Path(path)
        return tok

    def save(self, path: str | Path) -> None:
        """Write the tokenizer JSON atomically (temporary file in the same directory, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            self._tok.save(tmp)
            os.replace(tmp, path)
            self.path = path
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return str(self._tok.decode(values, skip_special_tokens=False))

    def encode_documents(self, docs: Sequence[str], separator: str) -> torch.Tensor:
        sep = self.encode(separator)
        # encode_batch_fast: Rust threads, and no character offsets (half the time of encode_batch).
        encodings = self._tok.encode_batch_fast(list(docs))
        parts = [torch.tensor(list(enc.ids) + sep, dtype=torch.int64) for enc in encodings]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


class HFDirTokenizer(Tokenizer):
    """The tokenizer of a Hugging Face model directory (``tokenizer.json``), with its BOS/EOS ids."""

    def __init__(self, directory: str | Path) -> None:
        import tokenizers

        d = Path(directory).expanduser()
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(
                f"data.tokenizer=hf:{d}: {d} has no tokenizer.json (the fast tokenizer file of "
                "save_pretrained). Save the tokenizer there, or set data.tokenizer=byte or bpe:N."
            )
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        self.spec = f"hf:{d}"
        self.path: Path | None = path
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._special(d, "bos")
        self.eos_id = self._special(d, "eos")

    def _special(self, d: Path, which: str) -> int | None:
        import json

        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            token = json.loads(cfg_path.read_text()).get(f"{which}_token")
            if isinstance(token, dict):
                token = token.get("content")
            found = self._tok.token_to_id(token) if isinstance(token, str) else None
            if found is not None:
                return int(found)
        model_cfg = d / "config.json"
        if model_cfg.is_file():
            value = json.loads(model_cfg.read_text()).get(f"{which}_token_id")
            if isinstance(value, int) and 0 <= value < self.vocab_size:
                return value
        return None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return str(self._tok.decode(values, skip_special_tokens=True))

    def wrap(self, ids: list[int]) -> list[int]:
        """``BOS + ids + EOS`` with the ids the model has."""
        bos = [self.bos_id] if self.bos_id is not None else []
        eos = [self.eos_id] if self.eos_id is not None else []
        return bos + ids + eos

    def encode_documents(self, docs: Sequence[str], separator: str) -> torch.Tensor:
        encodings = self._tok.encode_batch_fast(list(docs), add_special_tokens=False)
        parts = [torch.tensor(self.wrap(list(enc.ids)), dtype=torch.int64) for enc in encodings]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def parse_spec(spec: str) -> tuple[str, int]:
    """``"byte"`` -> ``("byte", 256)``; ``"bpe:4096"`` -> ``("bpe", 4096)``; anything else is a ConfigError."""
    if spec == "byte":
        return "byte", 256
    kind, _, size = spec.partition(":")
    if kind == "bpe":
        if not size.isdigit() or int(size) <= 256:
            raise ConfigError(
                f"data.tokenizer={spec!r}: the BPE vocabulary must be an integer above 256 (the byte "
                "alphabet), for example bpe:4096."
            )
        return "bpe", int(size)
    raise ConfigError(
        f"unknown data.tokenizer {spec!r}: use byte (the default) or bpe:N, for example bpe:4096."
    )


def _cache_key(spec: str, texts: Sequence[str]) -> str:
    h = hashlib.sha256(f"paratrain-tokenizer/{_CACHE_FORMAT}/{spec}\n".encode())
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: ("ab", "c") != ("a", "bc")
        h.update(data)
    return h.hexdigest()[:16]


def cache_path(cache_dir: str | Path, spec: str, train_texts: Sequence[str]) -> Path:
    """Where the BPE trained with ``spec`` on ``train_texts`` is cached."""
    _, size = parse_spec(spec)
    return Path(cache_dir) / f"tokenizer-bpe{size}-{_cache_key(spec, train_texts)}.json"


def build_tokenizer(spec: str, train_texts: Sequence[str], cache_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer named by ``spec``; a BPE is trained on ``train_texts`` or loaded from ``cache_dir``.

    With ``cache_dir=None`` a BPE is trained in memory and not saved.
    """
    if spec.startswith("hf:"):
        return HFDirTokenizer(spec[3:])
    kind, size = parse_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    path = cache_path(cache_dir, spec, train_texts) if cache_dir is not None else None
    if path is not None and path.is_file():
        return BPETokenizer.from_file(path, size)
    if not any(train_texts):
        raise ConfigError(f"data.tokenizer={spec!r} needs training text, and the training split is empty.")
    tok = BPETokenizer.train(train_texts, size)
    if path is not None:
        tok.save(path)
    return tok


def load_tokenizer(spec: str, path: str | Path | None = None) -> Tokenizer:
    """Reload a tokenizer for sampling: ``byte`` needs no file; ``bpe:N`` reads the JSON at ``path``;
    ``hf:DIR`` reads ``DIR/tokenizer.json``."""
    if spec.startswith("hf:"):
        return HFDirTokenizer(spec[3:])
    kind, size = parse_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    if path is None or not Path(path).is_file():
        raise ConfigError(
            f"data.tokenizer={spec!r} needs its trained file, and {str(path)!r} is not one: pass the "
            "tokenizer-bpe*.json written into the run directory by training."
        )
    return BPETokenizer.from_file(path, size)
