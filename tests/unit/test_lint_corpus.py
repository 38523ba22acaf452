"""The lint corpus (tests/lint_corpus/): every file's default-tier findings are exactly those in MANIFEST.toml.

Real public training scripts (copied unchanged at a named commit) must stay as quiet as their manifest entry
says, and every known-bad script written for the test must be found, by the default rules alone.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from paratrain.lint import lint_paths

CORPUS = Path(__file__).resolve().parents[1] / "lint_corpus"
MANIFEST = tomllib.loads((CORPUS / "MANIFEST.toml").read_text())["file"]
# The official PyTorch examples: no false finding is allowed on them (real mistakes in them are reported).
OFFICIAL = (
    "real/pytorch_examples/distributed/ddp/",
    "real/pytorch_examples/distributed/ddp-tutorial-series/",
    "real/pytorch_examples/distributed/FSDP2/",
    "real/pytorch_examples/distributed/tensor_parallelism/",
)


def test_manifest_lists_every_corpus_file() -> None:
    files = {p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*.py")}
    assert files == set(MANIFEST)
    for rel, entry in MANIFEST.items():
        if rel.startswith("real/"):
            assert {"source", "path", "commit", "license"} <= set(entry), rel
            assert (CORPUS / "real" / rel.split("/")[1] / "LICENSE").is_file(), rel
        for f in entry["findings"]:
            assert f["verdict"] in ("real", "wrong") and f["why"], (rel, f)


@pytest.mark.parametrize("rel", sorted(MANIFEST))
def test_findings_exactly_as_in_manifest(rel: str) -> None:
    report = lint_paths([CORPUS / rel])
    assert report.files == 1
    found = [(f.line, f.rule) for f in report.findings]
    assert found == [(f["line"], f["rule"]) for f in MANIFEST[rel]["findings"]]


def test_every_known_bad_file_is_found() -> None:
    for rel, entry in MANIFEST.items():
        if rel.startswith("bad/"):
            assert any(f["verdict"] == "real" for f in entry["findings"]), f"{rel}: its mistake is not found"


def test_no_false_finding_on_official_examples_or_known_correct_files() -> None:
    wrong = {
        rel: [f for f in e["findings"] if f["verdict"] != "real"]
        for rel, e in MANIFEST.items()
        if rel.startswith((*OFFICIAL, "good/"))
    }
    assert {rel: fs for rel, fs in wrong.items() if fs} == {}
    assert all(not MANIFEST[rel]["findings"] for rel in MANIFEST if rel.startswith("good/"))


def test_default_tier_precision_at_least_90_percent() -> None:
    verdicts = [f["verdict"] for e in MANIFEST.values() for f in e["findings"]]
    assert verdicts and verdicts.count("real") / len(verdicts) >= 0.9
