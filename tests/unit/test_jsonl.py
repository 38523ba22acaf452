"""``--data jsonl:PATH``: records read and checked (file:line of every bad one), prompt labels masked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain.data.jsonl import IGNORE, pack_records, read_records
from paratrain.data.tokenizers import ByteTokenizer
from paratrain.errors import ConfigError


def test_bad_records_are_reported_with_file_and_line(tmp_path: Path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "fine"}\n\n{"txt": "typo"}\nnot json\n')
    (d / "b.jsonl").write_text('{"prompt": "q", "completion": ""}\n[1, 2]\n{"text": ""}\n')
    with pytest.raises(ConfigError) as e:
        read_records(str(d))
    msg = str(e.value)
    assert "5 bad record(s)" in msg
    for where in ("a.jsonl:3: no 'text' field (keys: txt)", "a.jsonl:4: not JSON", "b.jsonl:1: empty 'completion'",
                  "b.jsonl:2: a JSON list", "b.jsonl:3: 'text' is empty"):  # fmt: skip
        assert where in msg, msg
    # a .json file may hold one JSON array of records, beside JSON-lines files; its bad ones are named file[i]
    (d / "b.jsonl").unlink()
    (d / "c.json").write_text('[{"text": "one"},\n {"prompt": "q", "completion": "a"},\n {"txt": 1}]')
    (d / "a.jsonl").write_text('{"text": "fine"}\n')
    with pytest.raises(ConfigError, match=r"1 bad record\(s\): c.json\[2\]: no 'text' field"):
        read_records(str(d))
    (d / "c.json").write_text('[{"text": "one"}, {"prompt": "q", "completion": "a"}]')
    assert read_records(str(d)) == [
        ("a.jsonl:1", None, "fine"),
        ("c.json[0]", None, "one"),
        ("c.json[1]", "q", "a"),
    ]
    (d / "c.json").unlink()
    (d / "a.jsonl").write_text('{"body": "x"}\n')
    assert read_records(str(d), text_field="body") == [("a.jsonl:1", None, "x")]
    with pytest.raises(ConfigError, match="no such file"):
        read_records(str(tmp_path / "missing.jsonl"))


class _WithSpecials(ByteTokenizer):
    bos_id, eos_id = 1, 2


def test_prompt_labels_are_ignored_and_completion_labels_kept() -> None:
    tok = _WithSpecials()
    records = [("f:1", "ab", "cd"), ("f:2", None, "xy")]
    # stream: BOS a b c d EOS | BOS x y EOS  (10 tokens) -> one chunk of seq_len + 1 = 10
    x, y = pack_records(records, tok, seq_len=9)
    assert x.tolist() == [[1, 97, 98, 99, 100, 2, 1, 120, 121]]
    # labels: a, b are prompt (ignored), c d EOS predicted; the next BOS is not predicted; x y EOS are
    assert y.tolist() == [[IGNORE, IGNORE, 99, 100, 2, IGNORE, 120, 121, 2]]
    assert y.dtype == torch.int64
