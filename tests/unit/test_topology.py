"""Topology validation, the DeviceMesh built from it (on PyTorch's fake process group), and the sharded
strategies' checks, which run in the launching process before any worker starts."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from paratrain.config import ConfigError, StrategyConfig
from paratrain.parallel import check_strategy, get_strategy
from paratrain.parallel.topology import Topology, build_mesh


def test_product_must_equal_world_size_and_message_prints_every_factor() -> None:
    with pytest.raises(ConfigError) as e:
        Topology(8, dp_replicate=3, dp_shard=2)
    msg = str(e.value)
    for part in ("pp 1", "replicate 3", "shard 2", "tp 1", "= 6", "world size is 8"):
        assert part in msg
    with pytest.raises(ConfigError, match="positive integer"):
        Topology(4, dp_shard=0)


def test_infer_fills_the_free_degree() -> None:
    t = Topology.infer(16, dp_replicate=2, tp=2)
    assert (t.pp, t.dp_replicate, t.dp_shard, t.tp) == (1, 2, 4, 2)
    assert t.dp_size == 8
    assert t.describe() == "pp 1 x dp_replicate 2 x dp_shard 4 x tp 2 = 16 ranks"
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        Topology.infer(6, tp=4)
    with pytest.raises(ConfigError, match="at most one"):
        Topology.infer(8, dp_shard=-1, tp=-1)


def test_coordinates_are_row_major_with_tp_innermost() -> None:
    t = Topology(8, dp_replicate=2, dp_shard=2, tp=2)
    assert t.coordinates(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 0}
    assert t.coordinates(1) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 1}
    assert t.coordinates(6) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "tp": 0}
    with pytest.raises(ValueError):
        t.coordinates(8)


@pytest.fixture
def fake_world() -> Iterator[int]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = 16
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=world)
    yield world
    dist.destroy_process_group()


def test_build_mesh_on_a_large_fake_world(fake_world: int) -> None:
    t = Topology(fake_world, dp_replicate=2, dp_shard=4, tp=2)
    mesh = build_mesh(t, "cpu")
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert tuple(mesh.shape) == (2, 4, 2)
    # rank 5 = replicate 0, shard 2, tp 1: its shard group is the ranks that differ only along "dp_shard"
    assert t.coordinates(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 2, "tp": 1}
    assert mesh["dp_shard"].mesh.tolist() == [1, 3, 5, 7]
    assert mesh["dp_replicate"].mesh.tolist() == [5, 13]
    hsdp = build_mesh(Topology(fake_world, dp_replicate=1, dp_shard=16), "cpu", ("dp_replicate", "dp_shard"))
    assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard") and tuple(hsdp.shape) == (1, 16)
    with pytest.raises(ValueError, match="must be part of the mesh"):
        build_mesh(t, "cpu", ("dp_shard", "tp"))


def _cfg(**kw: object) -> StrategyConfig:
    return StrategyConfig(**kw)  # type: ignore[arg-type]


def test_shard_size_must_divide_world_size() -> None:
    hsdp = get_strategy("hsdp")
    with pytest.raises(
        ConfigError, match=r"--shard-size 3 does not divide the data-parallel size 4.*1, 2, 4"
    ):
        check_strategy(hsdp, 4, _cfg(name="hsdp", shard_size=3))
    with pytest.raises(ConfigError, match="does not divide"):
        check_strategy(hsdp, 4, _cfg(name="hsdp", shard_size=8))
    check_strategy(hsdp, 8, _cfg(name="hsdp", shard_size=4))
    assert hsdp.topology_for(8, _cfg(name="hsdp")).degrees() == {
        "pp": 1,
        "dp_replicate": 2,
        "dp_shard": 4,
        "tp": 1,
    }


def test_hsdp_needs_two_ranks() -> None:
    with pytest.raises(ConfigError, match="hsdp needs at least 2 data-parallel ranks.*there are 1"):
        check_strategy(get_strategy("hsdp"), 1, _cfg(name="hsdp"))


@pytest.mark.parametrize("name", ["ddp", "single", "zero1", "zero2"])
def test_offload_only_with_strategies_that_can(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"--offload .* strategy '{name}'.*can offload: hsdp, zero3"):
        check_strategy(get_strategy(name), 2, _cfg(name=name, offload=True))


@pytest.mark.parametrize("name", ["ddp", "dp", "zero1", "zero2", "tp", "pp", "fsdp+pp", "fsdp+tp+pp"])
def test_shard_accumulated_grads_only_with_fsdp_without_a_pipeline(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"--shard-accumulated-grads .*not '{re.escape(name)}'"):
        check_strategy(get_strategy(name), 4, _cfg(name=name, shard_accumulated_grads=True))
    for ok in ("zero3", "hsdp", "fsdp+tp"):
        check_strategy(get_strategy(ok), 4, _cfg(name=ok, shard_accumulated_grads=True))


def test_other_sharding_options_are_refused_where_they_do_not_apply() -> None:
    with pytest.raises(ConfigError, match="applies to hsdp only"):
        check_strategy(get_strategy("zero3"), 4, _cfg(name="zero3", shard_size=2))
    with pytest.raises(ConfigError, match="--precision bf16"):
        check_strategy(get_strategy("zero2"), 4, _cfg(name="zero2", mixed_precision="bf16"))
    check_strategy(get_strategy("fsdp"), 4, _cfg(name="fsdp", offload=True, mixed_precision="bf16"))
    with pytest.raises(ConfigError, match="mixed_precision"):
        StrategyConfig(mixed_precision="fp8")


@pytest.mark.parametrize(
    ("name", "kw", "match"),
    [
        ("ddp", {"loss_parallel": True}, "--loss-parallel applies to tensor parallelism, which strategy 'ddp'"),
        ("zero3", {"sequence_parallel": False}, "--no-sequence-parallel applies to tensor parallelism"),
        ("ddp", {"pp_schedule": "gpipe", "microbatches": 3},
         "--pp-schedule gpipe --microbatches 3 applies to a pipeline, which strategy 'ddp' does not have. Use "
         "a strategy with a pipeline \\(fsdp\\+ep\\+pp, fsdp\\+pp, fsdp\\+tp\\+pp, pp\\), or leave them out."),
        ("tp", {"microbatches": 2}, "--microbatches 2 applies to a pipeline, which strategy 'tp'"),
        ("pp", {"loss_parallel": True}, "--loss-parallel applies to tensor parallelism, which strategy 'pp'"),
        ("single", {"pp_schedule": "interleaved-1f1b"}, "--pp-schedule interleaved-1f1b applies to a pipeline"),
    ],
)  # fmt: skip
def test_model_parallel_flags_are_refused_by_strategies_without_that_axis(
    name: str, kw: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        check_strategy(get_strategy(name), 2 if name != "single" else 1, _cfg(name=name, **kw))


def test_model_parallel_flags_are_accepted_where_they_apply() -> None:
    check_strategy(get_strategy("fsdp+tp+pp"), 4, _cfg(name="fsdp+tp+pp", loss_parallel=True, microbatches=2,
                                                       pp_schedule="gpipe", sequence_parallel=False))  # fmt: skip
    check_strategy(get_strategy("fsdp+tp"), 2, _cfg(name="fsdp+tp", loss_parallel=True))


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "fsdp"])
@pytest.mark.parametrize("kw", [{"dp_replicate": 2}, {"dp_shard": 2}])
def test_zero_stages_refuse_a_replicate_axis_they_would_never_average(name: str, kw: dict[str, int]) -> None:
    """zero1/2/3 synchronise over ``dp_shard`` only: with 2 replicas of 2 on 4 ranks each replica trained on
    its own data and the run silently differed from zero2 on 4 ranks (hsdp is the hybrid form)."""
    flag = "--dp-replicate 2" if "dp_replicate" in kw else "--dp-shard 2"
    with pytest.raises(ConfigError, match=rf"shards over all 4 data-parallel ranks, but {flag} splits them into 2 "
                       r"replicas of 2.*--strategy hsdp --dp-replicate 2"):  # fmt: skip
        check_strategy(get_strategy(name), 4, _cfg(name=name, **kw))
    # the degrees they have anyway are accepted, and hsdp takes the hybrid layout
    check_strategy(get_strategy(name), 4, _cfg(name=name, dp_replicate=1, dp_shard=4))
    check_strategy(get_strategy("hsdp"), 4, _cfg(name="hsdp", **kw))
