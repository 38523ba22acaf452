"""Which ``--comm-algorithm`` each strategy takes (refused in the launching process with one clear message),
and the ``shm`` algorithm's registration in ``comm``."""

from __future__ import annotations

import re

import pytest

from paratrain.config import COMM_ALGORITHMS, StrategyConfig
from paratrain.errors import ConfigError
from paratrain.parallel.registry import available_strategies, get_strategy
from paratrain.spec.refusals import check_comm_algorithm


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
def test_ddp_and_zero_take_native_and_shm_only(name: str) -> None:
    cls = get_strategy(name)
    for alg in ("native", "shm"):
        cls.check(2, StrategyConfig(name=name, comm_algorithm=alg))
    for alg in set(COMM_ALGORITHMS) - {"native", "shm"}:
        with pytest.raises(ConfigError, match=f"--comm-algorithm '{alg}' is not available") as e:
            cls.check(2, StrategyConfig(name=name, comm_algorithm=alg))
        assert "'shm'" in str(e.value)


@pytest.mark.parametrize(
    "name", ["single", "zero3", "fsdp", "hsdp", "tp", "fsdp+tp", "pp", "fsdp+pp", "fsdp+tp+pp"]
)
def test_other_strategies_refuse_every_algorithm_but_native(name: str) -> None:
    cls = get_strategy(name)
    assert cls.comm_algorithms == ("native",)
    for alg in set(COMM_ALGORITHMS) - {"native"}:
        with pytest.raises(
            ConfigError, match=re.escape(f"{cls.name}: --comm-algorithm '{alg}' is not available")
        ) as e:
            check_comm_algorithm(cls.name, alg)
        takers = {n for n in available_strategies(False) if alg in get_strategy(n).comm_algorithms}
        assert f"Strategies that take '{alg}': {', '.join(sorted(takers))}." in str(e.value)
    check_comm_algorithm(cls.name, "native")


def test_dp_takes_every_algorithm() -> None:
    cls = get_strategy("dp")
    for alg in set(COMM_ALGORITHMS) - {"pairwise"}:  # pairwise is an all-to-all (expert parallelism)
        cls.check(2, StrategyConfig(name="dp", comm_algorithm=alg))
    assert "shm" in COMM_ALGORITHMS


def test_shm_is_registered_for_every_collective_it_implements_and_has_no_alpha_beta_prediction() -> None:
    from paratrain.comm import ALGORITHMS
    from paratrain.spec.cost import LinkModel, predict

    for fn in ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter"):
        assert "shm" in ALGORITHMS[fn]
        assert predict(fn, "shm", 4, 1 << 20, LinkModel(1e-4, 1e-9, 1e-10)) is None  # memory-bound, not α–β
