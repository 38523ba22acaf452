"""``--cpu-bind cores``: how the launcher's cores are split among the local ranks."""

from __future__ import annotations

import pytest

from paratrain.config import LaunchConfig
from paratrain.errors import ConfigError
from paratrain.launch import cpu_bind


@pytest.mark.parametrize(
    ("cores", "nproc", "blocks"),
    [
        (list(range(8)), 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (list(range(8)), 1, [list(range(8))]),
        (list(range(6)), 4, [[0], [1], [2], [3]]),  # 2 left over: equal blocks, not 2,2,1,1
        (list(range(7)), 2, [[0, 1, 2], [3, 4, 5]]),
        ([0, 1], 4, [[0], [1], [0], [1]]),  # more ranks than cores: round robin
        ([5], 3, [[5], [5], [5]]),
        ([3, 5, 9, 11], 2, [[3, 5], [9, 11]]),  # a cpuset with holes: its own cores, in order
    ],
)
def test_core_blocks(cores: list[int], nproc: int, blocks: list[list[int]]) -> None:
    assert cpu_bind.core_blocks(cores, nproc) == blocks
    assert cpu_bind.decode(cpu_bind.encode(blocks)) == blocks


def test_core_blocks_refuses_nothing_to_split() -> None:
    with pytest.raises(ValueError, match="at least one rank and one core"):
        cpu_bind.core_blocks([0, 1], 0)
    with pytest.raises(ValueError, match="at least one rank and one core"):
        cpu_bind.core_blocks([], 2)


def test_describe_names_every_rank_and_what_is_left() -> None:
    line = cpu_bind.describe(cpu_bind.core_blocks(list(range(6)), 4), list(range(6)))
    assert "local rank 0 on core 0" in line and "local rank 3 on core 3" in line
    assert "2 of 6 core(s) unused" in line
    line = cpu_bind.describe(cpu_bind.core_blocks([0, 1, 2, 3], 2), [0, 1, 2, 3])
    assert "local rank 1 on cores 2-3" in line and "unused" not in line
    assert "3 ranks share 2 core(s)" in cpu_bind.describe(cpu_bind.core_blocks([0, 1], 3), [0, 1])


def test_config_refuses_an_unknown_mode() -> None:
    with pytest.raises(ConfigError, match="cpu_bind"):
        LaunchConfig(cpu_bind="sockets")
