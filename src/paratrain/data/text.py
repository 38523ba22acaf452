"""Text corpora for language modelling, with no downloads: the Python standard library, or local files.

Sources (``--data NAME``):

- ``python-stdlib``: the ``.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), about 12 MB in 730 files for CPython 3.11. Directories named
  ``site-packages``, ``dist-packages`` (installed packages, not the stdlib), ``test``, ``tests`` and
  ``idle_test`` are skipped: the test suites are larger than the library itself and some distributions do
  not ship them, so skipping them keeps the corpus the same for every install of one Python version.
- ``text:PATH``: one text file, or every text file under a directory (recursively; names starting with a
  dot are skipped). A file is text when it has no NUL byte and decodes as UTF-8; other files are skipped.

**Order and split.** Files are listed by their path relative to the root, sorted, so every rank and every
run reads the same stream. The validation split goes by file: a file is held out when the first 8 bytes of
``sha256(relative path)``, read as a fraction of 2**64, fall below ``test_fraction``. Whether a file is held
out depends on its own name only, never on which other files exist or on ``max_bytes``. If that leaves a
side empty (a directory of very few files), the file with the smallest digest goes to validation, or the one
with the largest back to training. A corpus of one text file is split by lines instead: its last
``test_fraction`` of characters, rounded to a line start, is validation.

**Size cap.** ``max_bytes`` keeps a prefix of each split, in file order: ``(1 - test_fraction) * max_bytes``
bytes of training text and ``test_fraction * max_bytes`` of validation (the last file is cut).

**Tokens and packing.** The documents of a split are tokenized one by one and joined into one stream, each
followed by :data:`DOC_SEPARATOR`. The stream is cut into non-overlapping chunks of ``seq_len + 1`` tokens;
a chunk gives ``input_ids = chunk[:-1]`` and ``labels = chunk[1:]``, and the remainder shorter than a chunk
is dropped. ``x`` and ``y`` are int64 views of one ``[N, seq_len + 1]`` tensor, so the labels cost no memory.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.data.registry import Splits, TensorData
from paratrain.data.tokenizers import Tokenizer, build_tokenizer
from paratrain.errors import ConfigError, suggest

__all__ = [
    "DOC_SEPARATOR",
    "SOURCES",
    "STDLIB_SKIP_DIRS",
    "Document",
    "TextSplits",
    "build_text_splits",
    "is_validation_file",
    "list_corpus_files",
    "pack",
    "read_corpus",
    "stdlib_dir",
]

SOURCES = ("python-stdlib", "text")
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
DOC_SEPARATOR = "\n\n"
"""Text appended to every document in the token stream: a blank line between files."""


@dataclass(frozen=True)
class Document:
    name: str
    """Path relative to the corpus root, with ``/`` separators."""
    text: str


@dataclass
class TextSplits(Splits):
    """:class:`Splits` of a language-modelling corpus (``task == "lm"``): ``x`` are input ids ``[N, seq_len]``,
    ``y`` the next-token labels, ``num_outputs`` the vocabulary size, plus what the corpus was made of."""

    tokenizer: Tokenizer | None = None
    """The tokenizer that made the ids (for decoding samples). A BPE carries ``path``, its cached JSON."""
    train_files: tuple[str, ...] = ()
    test_files: tuple[str, ...] = ()
    train_tokens: int = 0
    """Tokens in the training stream before packing (the packed count is ``x.numel()``)."""
    test_tokens: int = 0
    split_by: str = "file"
    """``file`` (disjoint sets of files) or ``lines`` (one file cut in two)."""


def stdlib_dir() -> Path:
    """The standard-library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(
    root: Path, suffix: str | None = None, skip_dirs: frozenset[str] = frozenset()
) -> list[str]:
    """Paths relative to ``root`` (``/``-separated, sorted) of the files under it: names ending ``suffix``
    when given, hidden names and directories in ``skip_dirs`` left out, symbolic links not followed."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        rel = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            if os.path.isfile(os.path.join(dirpath, name)):
                found.append((rel / name).as_posix())
    return sorted(found)


def _digest(relpath: str) -> int:
    return int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")


def is_validation_file(relpath: str, test_fraction: float) -> bool:
    """The by-file split rule: held out when ``sha256(relpath)``'s first 8 bytes / 2**64 < test_fraction."""
    return _digest(relpath) < test_fraction * 2**64


def _split_files(relpaths: list[str], test_fraction: float) -> tuple[list[str], list[str]]:
    test = [p for p in relpaths if is_validation_file(p, test_fraction)]
    if not test:
        test = [min(relpaths, key=_digest)]
    elif len(test) == len(relpaths):
        test.remove(max(relpaths, key=_digest))
    held = set(test)
    return [p for p in relpaths if p not in held], sorted(test)


def _read_text(path: Path) -> str | None:
    """The file's text, or None when it is binary (a NUL byte, or not UTF-8)."""
    raw = path.read_bytes()
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_files(root: Path, relpaths: list[str], budget: int | None) -> list[Document]:
    """Documents in order, skipping binary and empty files, until ``budget`` UTF-8 bytes are taken."""
    docs: list[Document] = []
    used = 0
    for rel in relpaths:
        if budget is not None and used >= budget:
            break
        text = _read_text(root / rel)
        if not text:
            continue
        if budget is not None:
            data = text.encode("utf-8")
            if used + len(data) > budget:  # cut; drop a character split by the cut
                text = data[: budget - used].decode("utf-8", errors="ignore")
            used += len(text.encode("utf-8"))
        if text:
            docs.append(Document(rel, text))
    return docs


def _split_lines(doc: Document, test_fraction: float) -> tuple[Document, Document]:
    """The first ``1 - test_fraction`` of the characters (cut at a line start) and the rest."""
    cut = round(len(doc.text) * (1 - test_fraction))
    line_start = doc.text.rfind("\n", 0, cut) + 1
    if 0 < line_start < len(doc.text):
        cut = line_start
    cut = min(max(cut, 1), len(doc.text) - 1)
    return Document(doc.name, doc.text[:cut]), Document(doc.name, doc.text[cut:])


def _corpus_root(source: str, path: str | None) -> tuple[Path, list[str]]:
    if source == "python-stdlib":
        if path is not None:
            raise ConfigError(
                f"--data python-stdlib reads the interpreter's own library and takes no path, got {path!r}."
            )
        root = stdlib_dir()
        return root, list_corpus_files(root, suffix=".py", skip_dirs=STDLIB_SKIP_DIRS)
    if source == "text":
        if not path:
            raise ConfigError(
                "--data text needs a path: write --data text:PATH with a text file or a directory."
            )
        p = Path(path).expanduser()
        if not p.exists():
            raise ConfigError(
                f"text path {path!r} does not exist: pass --data text:PATH with an existing text file or "
                "directory of text files."
            )
        if p.is_file():
            return p.parent, [p.name]
        return p, list_corpus_files(p)
    raise ConfigError(f"unknown text source {source!r}. {suggest(source, SOURCES)}")


def read_corpus(
    source: str, path: str | None = None, test_fraction: float = 0.1, max_bytes: int | None = None
) -> tuple[list[Document], list[Document], str]:
    """``(train documents, validation documents, split_by)`` of ``source`` (see the module docstring)."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"data.test_fraction must be in (0, 1), got {test_fraction!r}.")
    if max_bytes is not None and max_bytes < 2:
        raise ConfigError(f"max_bytes must be at least 2 (one byte per split), got {max_bytes!r}.")
    root, relpaths = _corpus_root(source, path)
    where = path if source == "text" else f"the standard library at {root}"
    no_text = ConfigError(
        f"{where!s} holds no text: found {len(relpaths)} file(s), none of them non-empty UTF-8 text. "
        "Point --data text:PATH at a text file or a directory that contains text files."
    )
    if not relpaths:
        raise no_text
    train_budget = test_budget = None
    if max_bytes is not None:
        test_budget = max(1, round(max_bytes * test_fraction))
        train_budget = max(1, max_bytes - test_budget)
    if len(relpaths) >= 2:
        train_files, test_files = _split_files(relpaths, test_fraction)
        train = _read_files(root, train_files, train_budget)
        test = _read_files(root, test_files, test_budget)
        if train and test:
            return train, test, "file"
    # One text file (or too few files with text to fill both sides): cut the text by lines.
    docs = _read_files(root, relpaths, max_bytes)
    if not docs:
        raise no_text
    whole = Document(docs[0].name, DOC_SEPARATOR.join(d.text for d in docs))
    if len(whole.text) < 2:  # text, but too short to cut into a training and a validation part
        raise ConfigError(
            f"{where!s} is too short: it holds {len(whole.text)} character of text, fewer tokens than one "
            "sequence of --seq-len + 1 for each of the training and validation splits. Use more text."
        )
    first, rest = _split_lines(whole, test_fraction)
    return [first], [rest], "lines"


def pack(stream: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a 1-D token stream into ``N`` non-overlapping chunks of ``seq_len + 1``; drop the remainder.

    Returns ``(x, y)``, both ``[N, seq_len]`` int64 views of the chunks: ``x = chunk[:-1]``,
    ``y = chunk[1:]`` (the label of position ``t`` is the token at ``t + 1``).
    """
    if seq_len < 1:
        raise ConfigError(f"--seq-len must be a positive integer, got {seq_len!r}.")
    n = stream.numel() // (seq_len + 1)
    chunks = stream[: n * (seq_len + 1)].to(torch.int64).view(n, seq_len + 1)
    return chunks[:, :-1], chunks[:, 1:]


def build_text_splits(
    source: str,
    path: str | None,
    tokenizer: str = "byte",
    seq_len: int = 256,
    cache_dir: str | Path | None = None,
    max_bytes: int | None = None,
    test_fraction: float = 0.1,
) -> TextSplits:
    """Read ``source`` (``python-stdlib`` or ``text`` with ``path``), tokenize and pack both splits.

    ``tokenizer`` is ``byte`` or ``bpe:N``; a BPE is trained on the training split and cached in
    ``cache_dir`` (the run directory). The result is a :class:`Splits` with ``task="lm"``,
    ``input_shape=(seq_len,)`` and ``num_outputs`` the vocabulary size.
    """
    train_docs, test_docs, split_by = read_corpus(source, path, test_fraction, max_bytes)
    tok = build_tokenizer(tokenizer, [d.text for d in train_docs], cache_dir)
    train_ids = tok.encode_documents([d.text for d in train_docs], DOC_SEPARATOR)
    test_ids = tok.encode_documents([d.text for d in test_docs], DOC_SEPARATOR)
    x, y = pack(train_ids, seq_len)
    xt, yt = pack(test_ids, seq_len)
    for split, ids, packed in (("training", train_ids, x), ("validation", test_ids, xt)):
        if packed.shape[0] == 0:
            raise ConfigError(
                f"the {split} split of {source}{':' + path if path else ''} has {ids.numel()} tokens, fewer "
                f"than one sequence of --seq-len + 1 = {seq_len + 1}: lower --seq-len or use more text"
                f"{' (raise max_bytes)' if max_bytes is not None else ''}."
            )
    return TextSplits(
        train=TensorData(x, y),
        test=TensorData(xt, yt),
        task="lm",
        input_shape=(seq_len,),
        num_outputs=tok.vocab_size,
        tokenizer=tok,
        train_files=tuple(d.name for d in train_docs),
        test_files=tuple(d.name for d in test_docs),
        train_tokens=int(train_ids.numel()),
        test_tokens=int(test_ids.numel()),
        split_by=split_by,
    )
