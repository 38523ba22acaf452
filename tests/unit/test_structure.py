"""Structure rules the import linter cannot state: strategies ask a model's spec and a communicator, and never
import a model family or a transport (read from the source with ``ast``, imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import paratrain

SRC = Path(paratrain.__file__).parent

MODEL_INTERFACE = {"paratrain.models.spec"}
"""What ``parallel/`` may import from ``paratrain.models``: the spec and its lookups, no family module."""
TRANSPORTS = ("paratrain.comm.shm", "paratrain.comm._tcp")
"""Transports sit behind :mod:`paratrain.comm.communicator`; a strategy never imports one."""


def _imports(text: str, package: str) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import in ``text`` (a module of ``package``), absolute or relative,
    at any depth."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


def _violations(text: str, where: str, package: str = "paratrain.parallel") -> list[str]:
    """Imports in ``text`` of a model family (anything in ``paratrain.models`` but its spec) or a transport."""
    bad = []
    for line, module, names in _imports(text, package):
        targets = [f"{module}.{n}" for n in names] if module == "paratrain.models" else [module]
        for target in targets:
            family = target.startswith("paratrain.models.") and not any(
                target == m or target.startswith(m + ".") for m in MODEL_INTERFACE
            )
            transport = any(target == t or target.startswith(t + ".") or target.startswith(t + "_")
                            for t in TRANSPORTS)  # fmt: skip
            if family or transport:
                bad.append(f"{where}:{line} imports {target}")
    return bad


def test_no_strategy_names_a_model_class_or_imports_a_transport() -> None:
    files = sorted((SRC / "parallel").rglob("*.py"))
    assert len(files) > 10, files
    bad = [v for f in files for v in _violations(f.read_text(), str(f.relative_to(SRC)))]
    assert not bad, "parallel/ must ask the model spec and the communicator:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "want"),
    [
        ("from paratrain.models.moe import MoE\n", "paratrain.models.moe"),
        ("def f():\n    from ..models.llama import Llama\n", "paratrain.models.llama"),
        ("from paratrain.models import hf\n", "paratrain.models.hf"),
        ("import paratrain.comm.shm.segment\n", "paratrain.comm.shm.segment"),
        ("from paratrain.comm._tcp import Links\n", "paratrain.comm._tcp"),
        ("from paratrain.comm.shm_hier import x\n", "paratrain.comm.shm_hier"),
    ],
)
def test_the_rule_catches_each_form(source: str, want: str) -> None:
    """The check itself can fail: each form of a forbidden import is reported, the allowed ones are not."""
    bad = _violations(source, "probe.py")
    assert any(b.endswith(want) for b in bad), bad
    allowed = "from paratrain.models.spec import expert_layers\nfrom ..comm import communicator\n"
    assert _violations(allowed, "probe.py") == []


HAND_FLAGS = {"-h", "--help", "--json", "--config", "--set"}
"""Flags that set no config value (output format, the config file, ``--set``): declared by hand, as for train."""


@pytest.mark.parametrize(
    "command", [["generate"], ["bench", "comm"], ["bench", "scaling"], ["train"], ["plan"]]
)
def test_every_flag_of_a_command_is_a_config_field(command: list[str]) -> None:
    """Flags come from typed config fields (one generator): a command adds by hand only the flags that set
    no config value (``plan`` takes train's fields and its own :class:`PlanConfig`'s)."""
    from paratrain.bench.comm import BenchCommConfig
    from paratrain.bench.scaling import BenchScalingConfig
    from paratrain.cli import make_parser
    from paratrain.config import GenerateConfig, cli_options, command_options
    from paratrain.plan.options import PlanConfig

    parser = make_parser(command)
    for word in command:  # the command's own sub-parser
        sub = next(a for a in parser._actions if a.dest in ("command", "bench_command"))
        parser = sub.choices[word]  # type: ignore[index]
    flags = {s for a in parser._actions for s in a.option_strings}
    own = {"generate": GenerateConfig, "comm": BenchCommConfig, "scaling": BenchScalingConfig,
           "plan": PlanConfig}.get(command[-1])  # fmt: skip
    generated = {f for o in command_options(own) for f in o.flags} if own else set()
    if command[-1] in ("scaling", "train", "plan"):
        generated |= {f for o in cli_options("train") for f in o.flags}
    assert generated <= flags, sorted(generated - flags)  # every field is a flag
    generated |= {"--no-" + f.removeprefix("--") for f in generated}  # booleans' negative forms
    assert flags - generated <= HAND_FLAGS, sorted(flags - generated - HAND_FLAGS)


def test_plan_help_lists_every_cluster_preset_and_gpu() -> None:
    """``--cluster`` and ``--gpu`` name their values in the field docstrings; they must name what the tables hold."""
    from paratrain.config import command_options
    from paratrain.plan.options import PlanConfig
    from paratrain.spec import hardware

    help_of = {o.key: o.help for o in command_options(PlanConfig)}
    assert all(name in help_of["cluster"] for name in hardware.PRESETS), help_of["cluster"]
    assert all(g.key in help_of["gpu"] for g in hardware.GPUS if g.key), help_of["gpu"]


def test_bench_comm_help_lists_every_collective_and_op() -> None:
    """The help texts of ``--collectives`` and ``--op`` are written out; they must name what the code offers."""
    from paratrain.bench.comm import COLLECTIVES, OPS, BenchCommConfig
    from paratrain.config import command_options

    help_of = {o.key: o.help for o in command_options(BenchCommConfig)}
    assert all(c in help_of["collectives"] for c in COLLECTIVES), help_of["collectives"]
    assert all(op in help_of["op"] for op in OPS), help_of["op"]
