"""``--data jsonl:PATH``: records of text, or prompt/completion pairs, for language-model fine-tuning.

``PATH`` is one ``.jsonl``/``.json`` file or a directory of them (recursively, sorted by relative path). Each
line is one JSON object (a ``.json`` file may instead hold one JSON array of them) with either a text field (``text``; another name with ``--set data.text_field=NAME``)
or a ``prompt`` and a ``completion``. Every bad record (not JSON, not an object, the field missing or not a
string, empty) is reported with its file and line, all at once, before any worker starts.

**Tokens.** Each record becomes ``BOS + tokens + EOS`` (the ids the tokenizer has: the model's own with
``--model hf:DIR``); a prompt/completion record ``BOS + prompt + completion + EOS``. The records are
joined into one stream and packed into ``seq_len + 1`` chunks as for text (:func:`paratrain.data.text.pack`).

**Completion-only loss.** With prompt/completion, the label of a position whose next token belongs to a
prompt (or is the BOS) is :data:`IGNORE` (-100): only completion tokens and the EOS are predicted. The
trainer then normalises the summed cross-entropy by the number of predicted tokens of the whole global
batch (counted once per step), so the loss and the gradient are the same for every strategy, world size
and accumulation, as with unmasked text.

**Split.** Records are held out by a digest of ``file:line`` (``test_fraction`` of them), independent of
the other records.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from paratrain.config import DataConfig
from paratrain.data.registry import Splits, TensorData, register_dataset
from paratrain.data.text import TextSplits
from paratrain.data.tokenizers import Tokenizer, build_tokenizer
from paratrain.errors import ConfigError

__all__ = ["IGNORE", "Record", "build_jsonl_splits", "pack_records", "read_records"]

IGNORE = -100
"""Label of a position that is not predicted (``torch.nn.functional.cross_entropy``'s ``ignore_index``)."""

Record = tuple[str, str | None, str]
"""``(where, prompt or None, text or completion)``; ``where`` is ``file:line``."""


def _files(path: str | None) -> tuple[Path, list[Path]]:
    if not path:
        raise ConfigError(
            "--data jsonl needs a path: write --data jsonl:PATH with a .jsonl file or a directory."
        )
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"--data jsonl:{path}: no such file or directory.")
    if p.is_file():
        return p.parent, [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".jsonl", ".json"))
    if not files:
        raise ConfigError(f"--data jsonl:{path}: the directory holds no .jsonl or .json file.")
    return p, files


def _entries(f: Path, rel: Path) -> list[tuple[str, object]]:
    """``(where, parsed object or a JSONDecodeError)`` of each record of ``f``: one per non-blank line, or,
    for a ``.json`` file holding one JSON array, one per element (``where``: ``file:line``, ``file[i]``)."""
    text = f.read_text(encoding="utf-8", errors="replace")
    if f.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            return [(f"{rel}:{e.lineno}", e)]
        if isinstance(items, list):
            return [(f"{rel}[{i}]", obj) for i, obj in enumerate(items)]
    out: list[tuple[str, object]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append((f"{rel}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                out.append((f"{rel}:{n}", e))
    return out


def read_records(path: str | None, text_field: str = "text") -> list[Record]:
    """Every record of ``path``; all bad records are reported in one :class:`ConfigError` (file:line)."""
    root, files = _files(path)
    records: list[Record] = []
    bad: list[str] = []
    for f in files:
        rel = f.relative_to(root) if f != root else Path(f.name)
        for where, obj in _entries(f, rel):
            if isinstance(obj, json.JSONDecodeError):
                bad.append(f"{where}: not JSON ({obj.msg})")
            elif not isinstance(obj, dict):
                bad.append(f"{where}: a JSON {type(obj).__name__}, not an object")
            elif "prompt" in obj or "completion" in obj:
                prompt, completion = obj.get("prompt"), obj.get("completion")
                if not isinstance(prompt, str) or not isinstance(completion, str):
                    bad.append(f"{where}: 'prompt' and 'completion' must both be strings")
                elif not completion:
                    bad.append(f"{where}: empty 'completion'")
                else:
                    records.append((where, prompt, completion))
            elif text_field not in obj:
                bad.append(f"{where}: no {text_field!r} field (keys: {', '.join(sorted(obj)) or 'none'})")
            elif not isinstance(obj[text_field], str) or not obj[text_field]:
                bad.append(f"{where}: {text_field!r} is empty or not a string")
            else:
                records.append((where, None, obj[text_field]))
    if bad:
        raise ConfigError(
            f"--data jsonl:{path}: {len(bad)} bad record(s): " + "; ".join(bad[:5])
            + (f"; ... ({len(bad) - 5} more)" if len(bad) > 5 else "")
            + f". Each line must be a JSON object with a {text_field!r} string (--set data.text_field=NAME) "
            "or 'prompt' and 'completion' strings."
        )  # fmt: skip
    if not records:
        raise ConfigError(f"--data jsonl:{path}: no records.")
    return records


def _special(tok: Tokenizer) -> tuple[list[int], list[int]]:
    bos, eos = getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)
    return ([bos] if bos is not None else []), ([eos] if eos is not None else [])


def pack_records(records: list[Record], tok: Tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of ``[N, seq_len]``: records tokenized, joined, packed; prompt labels set to :data:`IGNORE`."""
    bos, eos = _special(tok)
    ids: list[int] = []
    target: list[bool] = []  # whether the token at this position is predicted (is a label)
    for _, prompt, text in records:
        head = bos + (tok.encode(prompt) if prompt is not None else [])
        body = tok.encode(text) + eos
        ids += head + body
        target += [prompt is None and k > 0 for k in range(len(head))] + [True] * len(body)
    n = len(ids) // (seq_len + 1)
    stream = torch.tensor(ids[: n * (seq_len + 1)], dtype=torch.int64).view(n, seq_len + 1)
    keep = torch.tensor(target[: n * (seq_len + 1)], dtype=torch.bool).view(n, seq_len + 1)
    x = stream[:, :-1].contiguous()
    y = torch.where(keep[:, 1:], stream[:, 1:], torch.full_like(stream[:, 1:], IGNORE)).contiguous()
    return x, y


def _held_out(where: str, fraction: float) -> bool:
    digest = hashlib.sha256(where.encode()).digest()[:8]
    return int.from_bytes(digest, "big") / 2**64 < fraction


def build_jsonl_splits(cfg: DataConfig) -> Splits:
    records = read_records(cfg.path, cfg.text_field)
    fraction = 0.1 if cfg.test_fraction == 0.2 else cfg.test_fraction
    test = [r for r in records if _held_out(r[0], fraction)] or records[-1:]
    train = [r for r in records if r not in test] or records
    tok = build_tokenizer(cfg.tokenizer, [r[2] for r in train], cfg.cache_dir)
    x, y = pack_records(train, tok, cfg.seq_len)
    xt, yt = pack_records(test, tok, cfg.seq_len)
    for split, packed in (("training", x), ("validation", xt)):
        if packed.shape[0] == 0:
            raise ConfigError(
                f"--data jsonl:{cfg.path}: the {split} records hold fewer tokens than one sequence of "
                f"--seq-len + 1 = {cfg.seq_len + 1}. Lower --seq-len or add records."
            )
    return TextSplits(
        train=TensorData(x, y), test=TensorData(xt, yt), task="lm", input_shape=(cfg.seq_len,),
        num_outputs=tok.vocab_size, tokenizer=tok, train_tokens=int(x.numel()), test_tokens=int(xt.numel()),
    )  # fmt: skip


@register_dataset("jsonl")
def jsonl(cfg: DataConfig) -> Splits:
    return build_jsonl_splits(cfg)
