"""Precision and findings per 1,000 lines of ``paratrain lint`` on its corpus, and its start-up cost.

    python benchmarks/bench_lint_corpus.py [--repeats 5] [--out benchmarks/results/lint_corpus.json]
        [--src DIR --verdicts MANIFEST --label NAME]      # another revision's linter, for a "before" row

The corpus is tests/lint_corpus/ (MANIFEST.toml: every file's source, commit, licence and the verdict on
each default-tier finding: "real" mistake or "wrong", debatable counted as wrong). For each file the script
runs the default tier (what ``paratrain lint FILE`` runs) and the opt-in hygiene tier, and reports:

- precision = real / all default-tier findings, over the whole corpus, over the real public scripts only,
  and per rule (findings without a verdict in the manifest count as wrong: the test keeps them equal);
- findings per 1,000 lines (physical lines, comments included) on the real public scripts, per tier;
- CPU time to lint each file in-process (median, max), and the CPU time of a whole ``paratrain lint FILE``
  process (interpreter start-up included) on the largest real script, ``--repeats`` times.

Raw results (with the conditions: CPU, load average before the run) go to ``--out`` as JSON, one entry per
run with its ``label`` (``"current"``, or the ``--label`` given); docs/lint.md and BENCHMARKS.md quote them
(benchmarks/claims.toml). ``--src`` runs the linter of another source tree (``git archive REV src``) on the
same corpus, with the verdicts of ``--verdicts`` (that revision's manifest); a finding without a verdict
counts as wrong. An old linter without tiers runs all its rules by default, as its users saw.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "lint_corpus"
RESULTS = REPO / "benchmarks" / "results" / "lint_corpus.json"
HYGIENE = ["unsafe-torch-load", "no-destroy-process-group"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _process_cpu_s(path: Path, src: Path) -> float:
    """CPU seconds (user + system) of one ``paratrain lint FILE`` process, start-up included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        [sys.executable, "-c", "import sys; from paratrain.cli import main; sys.exit(main(sys.argv[1:]))",
         "lint", str(path)],
        env={**os.environ, "PYTHONPATH": str(src)},
        stdout=subprocess.DEVNULL,
        check=False,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _precision(verdicts: list[str]) -> float | None:
    return round(verdicts.count("real") / len(verdicts), 4) if verdicts else None


def measure(repeats: int, src: Path, verdicts: Path) -> dict[str, Any]:
    sys.path.insert(0, str(src))
    from paratrain.lint import lint_paths

    manifest = tomllib.loads(verdicts.read_text())["file"]
    files: list[dict[str, Any]] = []
    for rel in sorted(p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*.py")):
        path = CORPUS / rel
        judged = manifest.get(rel, {}).get("findings", [])
        expected = {(f["line"], f["rule"]): f["verdict"] for f in judged}
        t0 = time.process_time()
        default = lint_paths([path]).findings
        cpu = time.process_time() - t0
        hygiene = lint_paths([path], select=HYGIENE).findings
        files.append(
            {
                "path": rel,
                "kind": rel.split("/", 1)[0],
                "lines": len(path.read_text(encoding="utf-8").splitlines()),
                "lint_cpu_s": round(cpu, 5),
                "default": [
                    {"line": f.line, "rule": f.rule, "verdict": expected.get((f.line, f.rule), "unjudged")}
                    for f in default
                ],
                "hygiene": [{"line": f.line, "rule": f.rule} for f in hygiene],
            }
        )
    real = [f for f in files if f["kind"] == "real"]
    lines_real = sum(f["lines"] for f in real)
    all_verdicts = [x["verdict"] for f in files for x in f["default"]]
    real_verdicts = [x["verdict"] for f in real for x in f["default"]]
    per_rule: dict[str, list[str]] = {}
    for f in files:
        for x in f["default"]:
            per_rule.setdefault(x["rule"], []).append(x["verdict"])
    largest = max(real, key=lambda f: f["lines"])
    process = [_process_cpu_s(CORPUS / largest["path"], src) for _ in range(repeats)]
    cpu = [f["lint_cpu_s"] for f in files]
    return {
        "files": len(files),
        "real_files": len(real),
        "real_lines": lines_real,
        "default_findings": len(all_verdicts),
        "default_real": all_verdicts.count("real"),
        "precision_default": _precision(all_verdicts),
        "precision_default_real_scripts": _precision(real_verdicts),
        "default_findings_real_scripts": len(real_verdicts),
        "default_per_kloc_real_scripts": round(1000 * len(real_verdicts) / lines_real, 3),
        "hygiene_findings_real_scripts": sum(len(f["hygiene"]) for f in real),
        "hygiene_per_kloc_real_scripts": round(1000 * sum(len(f["hygiene"]) for f in real) / lines_real, 3),
        "hygiene_by_rule_real_scripts": dict(Counter(x["rule"] for f in real for x in f["hygiene"])),
        "precision_by_rule": {r: {"findings": len(v), "precision": _precision(v)} for r, v in sorted(per_rule.items())},
        "known_bad_found": sum(1 for f in files if f["kind"] == "bad" and any(x["verdict"] == "real" for x in f["default"])),
        "known_bad_files": sum(1 for f in files if f["kind"] == "bad"),
        "lint_cpu_s_median": round(statistics.median(cpu), 5),
        "lint_cpu_s_max": round(max(cpu), 5),
        "process_cpu_s_file": largest["path"],
        "process_cpu_s": [round(x, 3) for x in process],
        "per_file": files,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="paratrain lint processes timed (default 5)")
    p.add_argument(
        "--out", type=Path, default=RESULTS, help=f"JSON file to append the run to (default {RESULTS})"
    )
    p.add_argument("--src", type=Path, default=REPO / "src", help="the source tree whose paratrain.lint runs")
    p.add_argument(
        "--verdicts", type=Path, default=CORPUS / "MANIFEST.toml", help="the manifest holding the verdicts"
    )
    p.add_argument("--label", default="current", help='the run\'s label in the JSON (default "current")')
    args = p.parse_args(argv)
    load = os.getloadavg()
    result = measure(args.repeats, args.src.resolve(), args.verdicts)
    run = {
        "label": args.label,
        "when_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "conditions": {
            "cpu": _cpu_model(),
            "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in load],
            "python": platform.python_version(),
            "note": "shared machine, other engineers' jobs running: CPU times are upper bounds",
        },
        **result,
    }
    runs = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": [*runs, run]}, indent=1) + "\n")
    print(
        f"{run['files']} files ({run['real_files']} real public scripts, {run['real_lines']} lines): "
        f"default tier {run['default_findings']} findings, precision {run['precision_default']:.0%} "
        f"(real scripts: {run['default_findings_real_scripts']} findings, precision "
        f"{run['precision_default_real_scripts']:.0%}, {run['default_per_kloc_real_scripts']} per 1,000 lines); "
        f"hygiene tier {run['hygiene_findings_real_scripts']} on the real scripts; known bad found "
        f"{run['known_bad_found']}/{run['known_bad_files']}; lint CPU per file median {run['lint_cpu_s_median']}s "
        f"max {run['lint_cpu_s_max']}s; paratrain lint process {min(run['process_cpu_s'])}-{max(run['process_cpu_s'])}s CPU"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
