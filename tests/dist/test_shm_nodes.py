"""``--comm-algorithm shm`` on several nodes: :func:`paratrain.comm.shm.hier.node_groups` finds the nodes
(host and, under torchrun or ``paratrain launch``, the agent's ``GROUP_RANK``), ddp's hook and dp's
buckets then run the hierarchical all-reduce, and zero1/zero2 refuse. Four ranks on this host act as two
nodes of two by taking the ``GROUP_RANK`` a two-agent launch would give them (the real two-agent launch is
in ``tests/e2e/test_shm_cli.py``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist._reference import assert_matches, make_cfg, reference, train_cases

pytestmark = pytest.mark.dist

LAYOUTS = {
    "one node": lambda r: "0",
    "two nodes": lambda r: str(r // 2),  # torchrun's numbering: node by node
    "interleaved": lambda r: str(r % 2),  # ranks 0, 2 on one node: not node by node
    "uneven": lambda r: str(min(r, 1)),  # 1 + 3 ranks
}


def _layout(name: str) -> Any:
    from paratrain.comm.shm.hier import node_groups

    os.environ["GROUP_RANK"] = LAYOUTS[name](dist.get_rank())
    try:
        groups = node_groups()
    except ValueError as e:
        return str(e)
    if groups is None:
        return None
    return [dist.get_process_group_ranks(g) for g in groups]


@pytest.mark.timeout(120)
def test_node_groups_finds_the_nodes_and_refuses_layouts_it_cannot_split(dist_run: Any) -> None:
    for name in LAYOUTS:
        got = dist_run(_layout, 4, name, timeout_s=100)
        if name == "one node":
            assert got == [None] * 4
        elif name == "two nodes":
            for r, (intra, inter) in enumerate(got):
                assert intra == [r - r % 2, r - r % 2 + 1]  # this node's ranks
                assert inter == [r % 2, r % 2 + 2]  # the same local index on every node
        else:
            for msg in got:  # every rank raises, naming the layout
                assert isinstance(msg, str) and "numbered node by node" in msg, msg
                assert "node 0: ranks [0" in msg and "--comm-algorithm native" in msg


MLP = [
    "model.name=mlp", "model.hidden=32", "data.name=synthetic-classification", "data.num_samples=512",
    "train.steps=4", "train.batch_size=16", "optimizer.name=sgd", "optimizer.lr=0.05",
    "strategy.bucket_cap_mb=0.002", "strategy.comm_algorithm=shm",
]  # fmt: skip
CASES = {"ddp/shm": [*MLP, "strategy.name=ddp"], "dp/shm": [*MLP, "strategy.name=dp"]}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train_as_two_nodes(cases: list[list[str]], root: str) -> dict[str, Any]:
    from paratrain.errors import ConfigError

    os.environ["GROUP_RANK"] = str(dist.get_rank() // 2)
    lines = _Lines()
    logging.getLogger("paratrain").addHandler(lines)
    results = train_cases(cases, root)
    try:
        train_cases([[*MLP, "strategy.name=zero2"]], str(Path(root) / "zero2"))
        zero2 = "trained"
    except ConfigError as e:
        zero2 = str(e)
    return {"results": results, "log": lines.lines, "zero2": zero2}


@pytest.mark.timeout(300)
def test_ddp_and_dp_shm_on_two_nodes_match_single_process_and_zero2_refuses(
    dist_run: Any, tmp_path: Path
) -> None:
    out = dist_run(_train_as_two_nodes, 4, list(CASES.values()), str(tmp_path), timeout_s=280)
    for rank, o in enumerate(out):
        for who in ("ddp", "dp"):
            assert any(
                ln.startswith(f"{who} --comm-algorithm shm: hierarchical all-reduce over 2 nodes of 2 ranks")
                for ln in o["log"]
            ), (rank, o["log"])
        assert "ZeRO's reduce-scatter and all-gather through shared memory reach the ranks of one node" in (
            o["zero2"]
        ), o["zero2"]
    for (name, overrides), got in zip(CASES.items(), out[0]["results"], strict=True):
        assert_matches(got, reference(make_cfg(*overrides)), f"{name} x4 as 2 nodes")
        for o in out[1:]:  # the replicas stay identical across both nodes
            other = o["results"][list(CASES).index(name)]
            for k, v in got["local_params"].items():
                assert torch.equal(v, other["local_params"][k]), (name, k)
    assert out[0]["results"][1]["algorithm"] == "shm"
