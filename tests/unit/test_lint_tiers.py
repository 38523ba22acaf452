"""Rule tiers and selection (``--select``/``--extend-select``/``--ignore``, ``[tool.paratrain.lint]``), and the
passing and failing variants of the rules about ranks (unseeded-split, global-rank-as-device,
rank-independent-seed, context-manager-not-entered, local-rank-as-rank).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import pytest

from paratrain.lint import lint_source
from paratrain.lint.cli import add_arguments, run

SCRIPT = "import torch\nfrom torch import nn\nm = nn.DataParallel(nn.Linear(2, 2))\nx = torch.load('a')\n"


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="paratrain lint")
    add_arguments(parser)
    return run(parser.parse_args(list(argv)))


def rules_of(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [f["rule"] for f in json.loads(capsys.readouterr().out)["findings"]]


def test_pyproject_table_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "train.py"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path / "sub")  # the table is found in a parent directory
    assert cli("--json", str(script)) == 1 and rules_of(capsys) == ["data-parallel"]
    (tmp_path / "pyproject.toml").write_text('[tool.paratrain.lint]\nextend-select = ["hygiene"]\n')
    assert cli("--json", str(script)) == 1 and rules_of(capsys) == ["data-parallel", "unsafe-torch-load"]
    assert cli("--json", "--isolated", str(script)) == 1 and rules_of(capsys) == ["data-parallel"]
    assert cli("--json", "--ignore", "PTL001", str(script)) == 1 and rules_of(capsys) == ["unsafe-torch-load"]
    assert cli("--json", "--select", "data-parallel", str(script)) == 1 and rules_of(capsys) == [
        "data-parallel",
        "unsafe-torch-load",  # the file's extend-select still adds to a --select, as in ruff
    ]
    (tmp_path / "pyproject.toml").write_text('[tool.paratrain.lint]\nselect = ["PTL012"]\nignore = ["ALL"]\n')
    assert cli("--json", str(script)) == 0 and rules_of(capsys) == []


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('extend-selct = ["hygiene"]', "unknown key(s) extend-selct"),
        ('select = "hygiene"', "must be a list of rule ids"),
        ('ignore = ["unsafe-torch-lod"]', "Did you mean 'unsafe-torch-load'?"),
        ("select = [", "cannot read it as TOML"),
    ],
)
def test_bad_pyproject_table_is_one_usage_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    table: str,
    message: str,
) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "pyproject.toml").write_text(f"[tool.paratrain.lint]\n{table}\n")
    monkeypatch.chdir(tmp_path)
    assert cli(str(tmp_path / "train.py")) == 2
    err = capsys.readouterr().err
    assert message in err and "pyproject.toml" in err and len(err.strip().splitlines()) == 1


def test_list_rules_shows_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("--list-rules", "--json") == 0
    tiers = {r["id"]: r["tier"] for r in json.loads(capsys.readouterr().out)["rules"]}
    assert {k for k, v in tiers.items() if v == "hygiene"} == {
        "unsafe-torch-load",
        "no-destroy-process-group",
    }


HEAD = """\
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset, random_split

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
"""


def rules(body: str, head: str = HEAD) -> list[tuple[str, int]]:
    text = head + textwrap.dedent(body)
    return [(f.rule, f.line - head.count("\n")) for f in lint_source(text, "train.py")]


VARIANTS: list[tuple[str, str, list[tuple[str, int]]]] = [
    (
        "split after a same-on-every-rank seed",
        "torch.manual_seed(0)\nrandom_split(TensorDataset(torch.ones(4)), [2, 2])\n",
        [],
    ),
    (
        "split on rank 0 only",
        "if local_rank == 0:\n    random_split(TensorDataset(torch.ones(4)), [2, 2])\n",
        [],
    ),
    (
        "split after a per-rank seed",
        "torch.manual_seed(local_rank)\nrandom_split(TensorDataset(torch.ones(4)), [2, 2])\n",
        [("unseeded-split", 2)],
    ),
    (
        "sklearn split without random_state",
        "from sklearn.model_selection import train_test_split\na, b = train_test_split([1, 2, 3, 4])\n",
        [("unseeded-split", 2)],
    ),
    (
        "sklearn split with random_state",
        "from sklearn.model_selection import train_test_split\na, b = train_test_split([1, 2], random_state=0)\n",
        [],
    ),
    (
        "global rank from the environment as device",
        'rank = int(os.environ["RANK"])\ntorch.cuda.set_device(rank)\nx = torch.ones(1).to(rank)\n',
        [("global-rank-as-device", 2)],
    ),
    (
        "get_rank() in an f-string device",
        'device = f"cuda:{dist.get_rank()}"\n',
        [("global-rank-as-device", 1)],
    ),
    (
        "global rank modulo the GPU count is a choice",
        "rank = dist.get_rank()\ntorch.cuda.set_device(rank % torch.cuda.device_count())\n",
        [],
    ),
    ("a bare rank of unknown origin is not judged", "def f(rank):\n    torch.cuda.set_device(rank)\n", []),
    (
        "env seed computed from the rank through a name",
        "import gymnasium as gym\nseed = 7 + dist.get_rank()\nenv = gym.make('X')\nenv.reset(seed=seed)\n",
        [],
    ),
    (
        "env seed the same everywhere, via seed()",
        "import gymnasium as gym\nenv = gym.make('X')\nenv.action_space.seed(3)\n",
        [("rank-independent-seed", 3)],
    ),
    (
        "an environment held by an object, seeded the same everywhere",
        "class Runner:\n    def start(self):\n        self.train_env.reset(seed=0)\n",
        [("rank-independent-seed", 3)],
    ),
    ("a method that merely contains env in its name", "developer = object()\ndeveloper.seed(3)\n", []),
    ("env reset without a seed", "import gymnasium as gym\nenv = gym.make('X')\nenv.reset()\n", []),
    (
        "entered context managers and a decorator",
        "with torch.accelerator.device_index(local_rank):\n    pass\n@torch.no_grad()\ndef f():\n    pass\nctx = torch.autocast('cuda')\n",
        [],
    ),
    ("no_grad called as a statement", "torch.no_grad()\n", [("context-manager-not-entered", 1)]),
    (
        "cuda.device called as a statement",
        "torch.cuda.device(local_rank)\n",
        [("context-manager-not-entered", 1)],
    ),
    (
        "a thread's join is not a context manager",
        "import threading\nt = threading.Thread(target=print)\nt.join()\n",
        [],
    ),
    (
        "local rank to DistributedSampler",
        "from torch.utils.data import DistributedSampler\ns = DistributedSampler(TensorDataset(torch.ones(4)), rank=local_rank)\n",
        [("local-rank-as-rank", 2)],
    ),
    (
        "global rank to DistributedSampler",
        "from torch.utils.data import DistributedSampler\ns = DistributedSampler(TensorDataset(torch.ones(4)), rank=dist.get_rank())\n",
        [],
    ),
]


@pytest.mark.parametrize(("name", "body", "expected"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_rank_rule_variants(name: str, body: str, expected: list[tuple[str, int]]) -> None:
    assert rules(body) == expected


def test_spawned_processes_are_local_ranks() -> None:
    spawn = textwrap.dedent("""\
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp


        def worker(rank, world):
            dist.init_process_group("nccl", rank=rank, world_size=world)
            torch.cuda.set_device(dist.get_rank())


        mp.spawn(worker, args=(2,), nprocs=2)
        """)
    assert [f.rule for f in lint_source(spawn)] == []


def test_data_parallel_is_waste_not_reported_in_evaluation_or_fallback() -> None:
    train = "import torch\nfrom torch import nn\nm = nn.DataParallel(nn.Linear(2, 2))\nm(torch.ones(2, 2)).sum().backward()\n"
    (f,) = lint_source(train)
    assert (f.rule, f.severity) == ("data-parallel", "warning")  # slow, not wrong
    evaluation = "import torch\nfrom torch import nn\nm = nn.DataParallel(nn.Linear(2, 2)).eval()\nwith torch.no_grad():\n    m(torch.ones(2, 2))\n"
    assert lint_source(evaluation) == []
    fallback = textwrap.dedent("""\
        import torch
        from torch import nn
        model = nn.Linear(2, 2)
        if args.distributed:
            model = nn.parallel.DistributedDataParallel(model)
        else:
            model = nn.DataParallel(model)
        model(torch.ones(2, 2)).sum().backward()
        """)
    assert lint_source(fallback) == []
    two = "import torch\nfrom torch import nn\na = nn.DataParallel(nn.Linear(2, 2))\nb = nn.DataParallel(nn.Linear(2, 2))\na(torch.ones(2, 2)).sum().backward()\n"
    (f,) = lint_source(two)  # two models, one decision
    assert f.line == 3 and "(and 1 more here)" in f.message
