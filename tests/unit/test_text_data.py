"""Text corpora, tokenizers and packing: deterministic stdlib corpus, by-file split, BPE cache, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain.data import Splits
from paratrain.data.text import (
    DOC_SEPARATOR,
    build_text_splits,
    is_validation_file,
    list_corpus_files,
    pack,
    read_corpus,
    stdlib_dir,
)
from paratrain.data.tokenizers import BPETokenizer, ByteTokenizer, build_tokenizer, parse_spec
from paratrain.errors import ConfigError

SMALL = 60_000  # bytes of stdlib text: enough for every test, fast to read


def _write_corpus(root: Path, n_files: int = 12) -> None:
    """A small directory of Python-like text, with a hidden file and a binary file to be skipped."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        lines = [f"def function_{i}_{j}(value):\n    return value * {j} + {i}  # café\n" for j in range(20)]
        (root / f"mod_{i:02d}.py").write_text("".join(lines), encoding="utf-8")
    (root / ".hidden.txt").write_text("never read", encoding="utf-8")
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)


def test_stdlib_corpus_is_deterministic_and_library_only() -> None:
    a_train, a_test, split_by = read_corpus("python-stdlib", max_bytes=SMALL)
    b_train, b_test, _ = read_corpus("python-stdlib", max_bytes=SMALL)
    assert split_by == "file"
    assert a_train == b_train and a_test == b_test
    names = [d.name for d in a_train]
    assert names == sorted(names) and all(n.endswith(".py") for n in names)
    assert sum(len(d.text.encode()) for d in a_train + a_test) <= SMALL
    files = list_corpus_files(stdlib_dir(), suffix=".py", skip_dirs=frozenset({"site-packages", "test"}))
    assert files == sorted(files) and "os.py" in files
    everything = [d.name for d in read_corpus("python-stdlib", max_bytes=2_000_000)[0]]
    assert not any(part in {"site-packages", "test", "tests"} for n in everything for part in n.split("/"))


def test_split_is_by_file_and_disjoint() -> None:
    files = list_corpus_files(
        stdlib_dir(), suffix=".py", skip_dirs=frozenset({"site-packages", "test", "tests"})
    )
    held = [f for f in files if is_validation_file(f, 0.1)]
    assert 0.05 < len(held) / len(files) < 0.2  # a hash: about test_fraction of the files
    train, test, _ = read_corpus("python-stdlib", test_fraction=0.1, max_bytes=SMALL)
    train_names, test_names = {d.name for d in train}, {d.name for d in test}
    assert train_names and test_names and not train_names & test_names
    assert all(is_validation_file(n, 0.1) for n in test_names)
    assert not any(is_validation_file(n, 0.1) for n in train_names)


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    for text in ["", "def f():\n    return 1\n", "naïve café — 中文 🐍", "\x00\t\r\n"]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert tok.decode(torch.tensor(ids)) == text
    stream = tok.encode_documents(["ab", "é"], DOC_SEPARATOR)
    assert stream.dtype == torch.int64
    assert stream.tolist() == list(("ab" + DOC_SEPARATOR + "é" + DOC_SEPARATOR).encode())
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # a cut character decodes, never raises


def test_tokenizer_specs() -> None:
    assert parse_spec("byte") == ("byte", 256)
    assert parse_spec("bpe:4096") == ("bpe", 4096)
    for bad in ("bpe", "bpe:100", "bpe:x", "wordpiece:10"):
        with pytest.raises(ConfigError, match="data.tokenizer"):
            parse_spec(bad)


def test_bpe_trains_on_train_split_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus, cache = tmp_path / "corpus", tmp_path / "run"
    _write_corpus(corpus)
    first = build_text_splits("text", str(corpus), "bpe:300", seq_len=16, cache_dir=cache)
    files = list(cache.glob("tokenizer-bpe300-*.json"))
    assert len(files) == 1
    assert isinstance(first.tokenizer, BPETokenizer) and first.tokenizer.path == files[0]
    assert first.num_outputs == 300 and int(first.train.x.max()) < 300

    def no_training(*args: object, **kwargs: object) -> BPETokenizer:
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    second = build_text_splits("text", str(corpus), "bpe:300", seq_len=16, cache_dir=cache)
    assert torch.equal(first.train.x, second.train.x) and torch.equal(first.test.y, second.test.y)
    monkeypatch.undo()

    text = "def function_3_4(value):\n    return value  # naïve 🐍\n"
    assert second.tokenizer is not None and second.tokenizer.decode(second.tokenizer.encode(text)) == text
    assert len(second.tokenizer.encode(text)) < len(text.encode())  # it learned merges
    build_tokenizer("bpe:320", [d.text for d in read_corpus("text", str(corpus))[0]], cache)
    assert len(list(cache.glob("tokenizer-bpe*.json"))) == 2  # another vocabulary, another file


def test_pack_cuts_non_overlapping_chunks_and_shifts_labels() -> None:
    x, y = pack(torch.arange(23), seq_len=4)  # 23 // 5 = 4 chunks of 5; the last 3 tokens are dropped
    assert x.shape == y.shape == (4, 4) and x.dtype == y.dtype == torch.int64
    assert x[0].tolist() == [0, 1, 2, 3] and y[0].tolist() == [1, 2, 3, 4]
    assert x[1].tolist() == [5, 6, 7, 8]
    assert torch.equal(y, x + 1)
    assert pack(torch.arange(4), seq_len=4)[0].shape == (0, 4)


def test_build_text_splits_is_an_lm_splits() -> None:
    splits = build_text_splits("python-stdlib", None, "byte", seq_len=32, max_bytes=SMALL)
    assert isinstance(splits, Splits)
    assert (splits.task, splits.input_shape, splits.num_outputs) == ("lm", (32,), 256)
    x, y = splits.train.x, splits.train.y
    assert x.shape == y.shape and x.shape[1] == 32 and len(splits.test) > 0
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert splits.train_tokens >= x.numel() and splits.split_by == "file"
    first = "".join(d.text for d in read_corpus("python-stdlib", max_bytes=SMALL)[0])
    assert ByteTokenizer().decode(x[0]) == first.encode()[:32].decode("utf-8", errors="replace")
    assert not set(splits.train_files) & set(splits.test_files)


def test_text_path_directory_and_single_file(tmp_path: Path) -> None:
    _write_corpus(tmp_path / "c")
    splits = build_text_splits("text", str(tmp_path / "c"), seq_len=16)
    names = set(splits.train_files) | set(splits.test_files)
    assert names == {f"mod_{i:02d}.py" for i in range(12)}  # hidden and binary files skipped
    one = tmp_path / "c" / "mod_03.py"
    train, test, split_by = read_corpus("text", str(one), test_fraction=0.25)
    assert split_by == "lines" and train[0].text + test[0].text == one.read_text()
    assert test[0].text.startswith("def ")  # cut at a line start


def test_text_path_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=f"text path '{missing}' does not exist"):
        build_text_splits("text", str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no text"):
        build_text_splits("text", str(tmp_path / "empty"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.dat").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "bin" / "b.txt").write_bytes(b"\xff\xfe not utf-8 \xff")
    with pytest.raises(ConfigError, match="holds no text"):
        build_text_splits("text", str(tmp_path / "bin"))
    (tmp_path / "one.txt").write_text("x")  # text, only too short: not "holds no text"
    with pytest.raises(
        ConfigError, match=r"one.txt is too short: it holds 1 character of text, fewer tokens"
    ):
        build_text_splits("text", str(tmp_path / "one.txt"))
    with pytest.raises(ConfigError, match="needs a path"):
        build_text_splits("text", None)
    with pytest.raises(ConfigError, match="Did you mean 'text'"):
        build_text_splits("txt", None)
    _write_corpus(tmp_path / "c", n_files=2)
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        build_text_splits("text", str(tmp_path / "c"), seq_len=100_000)
