"""The torch-free run description (``paratrain.spec``): the planner and the launcher resolve every strategy to
the same layout and refuse the same inputs, and the commands that need no torch never import it."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.parallel import available_strategies, get_strategy
from paratrain.plan.layout import resolve as plan_resolve
from paratrain.plan.model import TransformerShape
from paratrain.spec import strategies as specs

# A shape that no degree of the grid below refuses for model reasons (heads and layers divide by any tp/pp).
_SHAPE = TransformerShape(dim=11520, n_layers=64, n_heads=5760, n_kv_heads=5760, ffn_hidden=8192, vocab_size=1024,
                          max_seq_len=128)  # fmt: skip
_WORLDS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_NODES = (1, 2, 4, 8)
_EXPLICIT: tuple[dict[str, int], ...] = (
    {},
    {"tp": 2},
    {"pp": 2},
    {"tp": 2, "pp": 2},
    {"dp_shard": 2},
    {"dp_replicate": 2},
    {"tp": 4, "dp_shard": 2},
)


def _train_layout(name: str, world: int, node: int, degrees: dict[str, int]) -> Any:
    """What ``paratrain train`` resolves before launch (the launcher's own calls), or the refusal's text."""
    cls = get_strategy(name)
    cfg = StrategyConfig(name=name, **degrees)  # type: ignore[arg-type]
    try:
        cls.check(world, cfg, node)
        return cls.topology_for(world, cfg, node).to_dict()
    except ConfigError as e:
        return f"refused: {e}"


def _plan_layout(name: str, world: int, node: int, degrees: dict[str, int]) -> Any:
    try:
        _, _, layout = plan_resolve(name, world, shape=_SHAPE, gpus_per_node=node, **degrees)  # type: ignore[arg-type]
        return layout.to_dict()
    except ConfigError as e:
        return f"refused: {e}"


@pytest.mark.parametrize("name", available_strategies(include_aliases=True))
def test_plan_and_train_resolve_every_strategy_to_the_same_layout(name: str) -> None:
    accepted = 0
    for world, node, degrees in itertools.product(_WORLDS, _NODES, _EXPLICIT):
        node = min(node, world)
        if world % node:
            continue
        train = _train_layout(name, world, node, degrees)
        plan = _plan_layout(name, world, node, degrees)
        assert plan == train, (name, world, node, degrees)
        accepted += isinstance(train, dict)
    assert accepted > 0, f"{name}: the grid never produced a layout"


def test_hsdp_shards_within_a_node_in_plan_and_train() -> None:
    # 32 ranks on 8-GPU nodes: shard over the 8 ranks of a node, replicate over the 4 nodes
    train = get_strategy("hsdp").topology_for(32, StrategyConfig(name="hsdp"), 8)
    _, _, plan = plan_resolve("hsdp", 32, shape=None, gpus_per_node=8)
    assert (train.dp_replicate, train.dp_shard) == (4, 8)
    assert plan == train
    # one node: half the ranks per shard group, as before
    assert get_strategy("hsdp").topology_for(4, StrategyConfig(name="hsdp"), 4).dp_shard == 2


def test_every_spec_has_an_implementation_and_back() -> None:
    assert set(available_strategies(include_aliases=False)) == set(specs.STRATEGIES)
    for name, spec in specs.STRATEGIES.items():
        cls = get_strategy(name)
        assert cls.spec is spec and cls.description == spec.description
        assert cls.uses_fsdp == spec.uses_fsdp and cls.comm_algorithms == spec.comm_algorithms


_BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is unimportable in this test: " + name)
            return None
    sys.meta_path.insert(0, _Block())
    """
)


def _run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip


@pytest.mark.timeout(180)
def test_plan_strategies_and_help_need_no_torch() -> None:
    proc = _run_without_torch(
        """
        import contextlib, io, json
        import paratrain.plan, paratrain.spec
        from paratrain.cli import main
        out = {}
        for key, argv in (("strategies", ["strategies", "--json"]),
                          ("plan4", ["plan", "--model", "llama-debug", "--strategy", "fsdp+tp", "--gpus", "4", "--json"]),
                          ("plan32", ["plan", "--model", "llama3-8b", "--strategy", "hsdp", "--gpus", "32",
                                      "--gpus-per-node", "8", "--json"]),
                          ("plan405", ["plan", "--model", "llama3-405b", "--set", "model.n_layers=8", "--strategy",
                                       "fsdp+tp+pp", "--gpus", "64", "--tp", "8", "--pp", "2", "--pp-schedule",
                                       "interleaved-1f1b", "--activation-checkpointing", "selective", "--batch-size",
                                       "16", "--seq-len", "4096", "--gpu", "h200", "--json"])):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = main(argv)
            out[key] = (rc, buf.getvalue().strip().splitlines()[-1])
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            main(["--help"])
        out["help"] = (0, json.dumps(buf.getvalue()))
        assert "torch" not in sys.modules
        print(json.dumps(out))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(rc == 0 for rc, _ in out.values()), out
    assert set(json.loads(out["strategies"][1])) == set(specs.names())
    assert json.loads(out["plan4"][1])["plans"][0]["layout"] == {
        "dp_replicate": 1,
        "dp_shard": 2,
        "tp": 2,
        "pp": 1,
    }
    assert json.loads(out["plan32"][1])["plans"][0]["layout"] == {
        "dp_replicate": 4,
        "dp_shard": 8,
        "tp": 1,
        "pp": 1,
    }
    assert "plan" in json.loads(out["help"][1])
    p405 = json.loads(out["plan405"][1])["plans"][0]
    assert p405["activation_checkpointing"] == "selective" and p405["pp_schedule"] == "interleaved-1f1b"
