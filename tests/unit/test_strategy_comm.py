"""Which ``--comm-algorithm`` each strategy takes (refused in the launching process with one clear message),
and the ``shm`` algorithm's registration in ``comm``."""

from __future__ import annotations

import pytest

from paratrain.config import COMM_ALGORITHMS, StrategyConfig
from paratrain.errors import ConfigError
from paratrain.parallel.registry import get_strategy


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
def test_ddp_and_zero_take_native_and_shm_only(name: str) -> None:
    cls = get_strategy(name)
    for alg in ("native", "shm"):
        cls.check(2, StrategyConfig(name=name, comm_algorithm=alg))
    for alg in set(COMM_ALGORITHMS) - {"native", "shm"}:
        with pytest.raises(ConfigError, match=f"--comm-algorithm '{alg}' is not available") as e:
            cls.check(2, StrategyConfig(name=name, comm_algorithm=alg))
        assert "'shm'" in str(e.value)


def test_dp_takes_every_algorithm() -> None:
    cls = get_strategy("dp")
    for alg in COMM_ALGORITHMS:
        cls.check(2, StrategyConfig(name="dp", comm_algorithm=alg))
    assert "shm" in COMM_ALGORITHMS


def test_shm_is_registered_for_every_collective_it_implements_and_has_no_alpha_beta_prediction() -> None:
    from paratrain.comm import ALGORITHMS
    from paratrain.comm.cost import LinkModel, predict

    for fn in ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter"):
        assert "shm" in ALGORITHMS[fn]
        assert predict(fn, "shm", 4, 1 << 20, LinkModel(1e-4, 1e-9, 1e-10)) is None  # memory-bound, not α–β
