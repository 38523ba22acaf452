"""Check every figure BENCHMARKS.md (and README.md) quotes against the stored JSON it comes from.

The index is ``benchmarks/claims.toml``: one ``[[claim]]`` per figure, with

- ``quote``: the text as the documents print it (``"1.02–1.15×"``, ``"0.04%"``); it must appear verbatim in
  BENCHMARKS.md, and in README.md too when ``readme = true``;
- ``figure`` (optional): the part of the quote that holds the number(s), when the quote has other digits;
- ``json``: the result file(s) under ``benchmarks/results/`` (glob patterns; each file's stored run counts);
- ``value``: a Python expression over ``docs`` (the loaded JSON files, in sorted path order) and ``doc``
  (the first of them) giving a number or a list of numbers, in the unit the quote uses;
- ``kind``: ``"range"`` (the default: the quote's one or two numbers are the minimum and maximum of the
  values, at the quote's precision), ``"upper"`` (every value is at most the quote's number) or ``"lower"``
  (every value is at least it);
- ``conditions``: where and how it was measured (CPU or GPU, ranks, host, load), for the reader.

A figure whose JSON changes, or a document edited without its index entry, fails the check: exit 1 with one
line per failure. ``--show`` prints each computed figure next to its quote.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
import sys
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"(?<![\d.])[−-]?\d+(?:\.\d+)?")
HELPERS: dict[str, Any] = {
    "min": min, "max": max, "abs": abs, "len": len, "sum": sum, "sorted": sorted, "round": round,
    "median": statistics.median, "mean": statistics.fmean, "float": float, "int": int, "any": any, "all": all,
}  # fmt: skip
MB = 1 << 20


def speedups(
    docs: list[dict[str, Any]],
    collectives: str,
    world: int,
    min_bytes: int,
    max_bytes: int,
    algorithm: str = "shm",
    baseline: str = "native",
) -> list[float]:
    """``baseline``'s time / ``algorithm``'s for every (file, run, collective, size) that has both, from the
    ``rows`` of bench_shm/bench_comm JSON; ``collectives`` is a comma-separated list."""
    times: dict[tuple[int, int, str, int], dict[str, float]] = {}
    for i, d in enumerate(docs):
        for r in d["rows"]:
            if (
                r["collective"] in collectives.split(",")
                and r["world_size"] == world
                and min_bytes <= r["bytes"] <= max_bytes
            ):
                times.setdefault((i, r.get("run", 0), r["collective"], r["bytes"]), {})[r["algorithm"]] = r[
                    "time_s"
                ]
    return [t[baseline] / t[algorithm] for t in times.values() if baseline in t and algorithm in t]


def _numbers(quote: str) -> list[tuple[float, int]]:
    """The numbers in ``quote`` with their count of decimals (a unicode minus is a minus)."""
    out = []
    for m in NUMBER.findall(quote):
        text = m.replace("−", "-")
        decimals = len(text.split(".")[1]) if "." in text else 0
        out.append((float(text), decimals))
    return out


def _values(claim: dict[str, Any]) -> list[float]:
    paths = sorted({p for pattern in _as_list(claim["json"]) for p in glob.glob(str(REPO / pattern))})
    if not paths:
        raise ValueError(f"no file matches {claim['json']}")
    docs = [json.loads(Path(p).read_text()) for p in paths]
    names = {**HELPERS, "speedups": speedups, "MB": MB, "docs": docs, "doc": docs[0]}
    got = eval(claim["value"], {"__builtins__": {}, **names})  # globals: comprehensions see them too
    values = [float(v) for v in (got if isinstance(got, list | tuple) else [got])]
    if not values:
        raise ValueError("the expression gave no value")
    return values


def _as_list(x: str | list[str]) -> list[str]:
    return [x] if isinstance(x, str) else list(x)


def check(claim: dict[str, Any], texts: dict[str, str]) -> tuple[list[str], str]:
    """(failures, what was computed) for one claim."""
    name, quote = claim["id"], claim["quote"]
    failures = []
    for doc in ["BENCHMARKS.md", *(["README.md"] if claim.get("readme") else [])]:
        if quote not in texts[doc]:
            failures.append(f"{name}: {doc} does not contain {quote!r}")
    try:
        values = _values(claim)
    except Exception as e:  # a missing file or key is a failed claim, with what went wrong
        return [*failures, f"{name}: cannot compute {claim['value']!r}: {type(e).__name__}: {e}"], "?"
    stated = _numbers(claim.get("figure", quote))
    lo, hi = min(values), max(values)
    kind = claim.get("kind", "range")
    if not stated:
        return [*failures, f"{name}: the quote {quote!r} has no number"], f"{lo:g}..{hi:g}"
    if kind == "range":
        want = [stated[0], stated[-1]] if len(stated) > 1 else [stated[0], stated[0]]
        for got, (num, dec) in zip((lo, hi), want, strict=True):
            if abs(got - num) > 0.5 * 10**-dec + 1e-9:
                failures.append(f"{name}: {quote!r} states {num:.{dec}f}, the JSON gives {got:.{dec + 2}f}")
    elif kind == "upper" and hi > stated[0][0] + 1e-12:
        failures.append(f"{name}: {quote!r} is a bound of {stated[0][0]}, the JSON reaches {hi:.6g}")
    elif kind == "lower" and lo < stated[0][0] - 1e-12:
        failures.append(f"{name}: {quote!r} is a floor of {stated[0][0]}, the JSON goes down to {lo:.6g}")
    return failures, (f"{lo:.4g}" if lo == hi else f"{lo:.4g}..{hi:.4g}") + f" ({len(values)} values)"


def readme_figures_unindexed(readme: str, claims: list[dict[str, Any]]) -> list[str]:
    """The rows of README.md's results table (``## Results``) whose figure column (the second) holds a
    number that no claim marked ``readme = true`` quotes: every README figure must be in BENCHMARKS.md and
    in the index."""
    section = readme.split("\n## Results", 1)[-1].split("\n## ", 1)[0]
    quotes = sorted((c["quote"] for c in claims if c.get("readme")), key=len, reverse=True)
    bad = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[1]) <= set("-: ") or cells[1] == "figure":
            continue
        rest = cells[1]
        for q in quotes:
            rest = rest.replace(q, "")
        if re.search(r"\d", rest):
            bad.append(
                f"README.md results row {cells[0]!r}: {cells[1]!r} has a figure that benchmarks/claims.toml "
                "does not index (add a claim with readme = true)"
            )
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", default=str(REPO / "benchmarks" / "claims.toml"))
    ap.add_argument("--show", action="store_true", help="print every computed figure next to its quote")
    args = ap.parse_args(argv)
    claims = tomllib.loads(Path(args.index).read_text())["claim"]
    texts = {doc: (REPO / doc).read_text() for doc in ("BENCHMARKS.md", "README.md")}
    ids = [c["id"] for c in claims]
    failures = [f"{i}: the id is used more than once" for i in sorted({i for i in ids if ids.count(i) > 1})]
    for claim in claims:
        bad, computed = check(claim, texts)
        failures += bad
        if args.show:
            print(f"{'FAIL' if bad else 'ok  '} {claim['id']:32s} {claim['quote']!s:24s} {computed}")
    failed = {f.split(":")[0] for f in failures}
    failures += readme_figures_unindexed(texts["README.md"], claims)
    for line in failures:
        print(f"check_claims: {line}", file=sys.stderr)
    print(
        f"check_claims: {len(claims) - len(failed & set(ids))} of {len(claims)} figures match their JSON",
        file=sys.stderr,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
