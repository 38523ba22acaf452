"""Model-parallel presets, Llama's TP plan and stage split: pure logic on meta-device models, no process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.models.llama import build_llama
from paratrain.models.llama_parallel import check_pipeline, pipeline_split, split_layers, tp_plan
from paratrain.parallel import check_strategy, get_strategy


def _degrees(name: str, world: int, **kw: object) -> dict[str, int]:
    cfg = StrategyConfig(name=name, **kw)  # type: ignore[arg-type]
    cls = get_strategy(name)
    check_strategy(cls, world, cfg)
    topo = cls.topology_for(world, cfg)
    # the launcher writes the resolved degrees back into the config; the workers must get the same
    again = cls.topology_for(
        world, dataclasses.replace(cfg, dp_replicate=topo.dp_replicate, dp_shard=topo.dp_shard)
    )
    assert again == topo, (name, world, kw)
    resolved = dataclasses.replace(
        cfg, dp_replicate=topo.dp_replicate, dp_shard=topo.dp_shard, tp=topo.tp, pp=topo.pp
    )
    check_strategy(cls, world, resolved)
    assert cls.topology_for(world, resolved) == topo, (name, world, kw)
    return topo.degrees()


@pytest.mark.parametrize(
    ("name", "world", "kw", "want"),
    [
        ("tp", 4, {}, {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 4}),
        ("tp", 4, {"tp": 2}, {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 2}),
        ("fsdp+tp", 8, {}, {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 2}),
        ("fsdp+tp", 8, {"tp": 4}, {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 4}),
        ("fsdp+tp", 8, {"tp": 2, "dp_replicate": 2}, {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 2}),
        ("pp", 3, {}, {"pp": 3, "dp_replicate": 1, "dp_shard": 1, "tp": 1}),
        ("pp", 4, {"pp": 2}, {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 1}),
        ("fsdp+pp", 4, {}, {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}),
        ("fsdp+tp+pp", 4, {}, {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 2}),
        ("fsdp+tp+pp", 8, {}, {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}),
        ("fsdp+tp+pp", 8, {"tp": 4}, {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 4}),
        # an explicit degree is kept, 1 included where the preset does not own that axis
        ("fsdp+tp", 4, {"pp": 1}, {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2}),
        ("ddp", 2, {"tp": 1, "pp": 1}, {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 1}),
    ],
)
def test_presets_fill_in_the_degrees(name: str, world: int, kw: dict[str, int], want: dict[str, int]) -> None:
    assert _degrees(name, world, **kw) == want


@pytest.mark.parametrize(
    ("name", "world", "kw", "match"),
    [
        ("tp", 4, {"pp": 2}, "has no pipeline"),
        ("pp", 4, {"tp": 2}, "does not split tensors"),
        ("tp", 4, {"tp": 2, "dp_shard": 2}, "needs FSDP: use --strategy fsdp\\+tp"),
        ("fsdp+tp", 4, {"tp": 3}, "tp 3 x pp 1 = 3 does not divide the world size 4"),
        ("pp", 2, {"pp_schedule": "1f1b", "microbatches": 1}, "at least as many micro-batches"),
        ("ddp", 4, {"tp": 2}, "data parallel only"),
        # a preset whose own axis would come out at degree 1: refused, not run without it
        ("fsdp+tp", 3, {}, "'fsdp\\+tp' on 3 ranks came out as tp 1: its tp axis would have degree 1"),
        ("fsdp+pp", 3, {}, "its pp axis would have degree 1"),
        ("fsdp+tp+pp", 2, {}, "came out as tp 2 x pp 1: its pp axis .* multiple of 4 ranks"),
        # an explicit --tp 1 / --pp 1 is not taken for "unset" (it used to be replaced by the default 2)
        ("tp", 2, {"tp": 1}, "'tp' splits the model over its tp axis, but --tp 1 was given.*--strategy ddp"),
        ("fsdp+tp", 4, {"tp": 1}, "--tp 1 was given.*divides the 4 ranks, or use --strategy zero3"),
        ("pp", 2, {"pp": 1}, "--pp 1 was given.*--strategy ddp"),
        ("fsdp+tp+pp", 4, {"pp": 1}, "--pp 1 was given.*--strategy fsdp\\+tp\\.$"),
        # an unset flag is not printed as None
        ("fsdp+tp", 2, {"tp": 2, "dp_shard": 2}, "^topology: --dp-shard 2 does not divide the 1 data"),
    ],
)
def test_bad_degrees_are_refused(name: str, world: int, kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_strategy(get_strategy(name), world, StrategyConfig(name=name, **kw))  # type: ignore[arg-type]


def _meta(**overrides: object) -> torch.nn.Module:
    return build_llama("llama-debug", overrides, device="meta")


def test_launch_checks_on_the_meta_model() -> None:
    cfg = StrategyConfig(name="tp")
    with pytest.raises(
        ConfigError, match=r"degree 4 does not divide the heads .*n_kv_heads=2.*--tp one of 2,"
    ):
        get_strategy("tp").check_model(_meta(), 4, cfg)
    get_strategy("tp").check_model(_meta(), 2, cfg)
    # every degree the message suggests is one the strategy accepts on that world (not 1, dividing the ranks)
    with pytest.raises(ConfigError, match=r"degree 3 does not divide the heads .* No degree above 1 divides both "
                       r"the heads \(divisors 1, 2\) and the 3 ranks: run on a multiple of 2 ranks"):  # fmt: skip
        get_strategy("tp").check_model(_meta(), 3, cfg)
    with pytest.raises(ConfigError, match=r"degree 4 does not divide .*Use --tp one of 2,"):
        get_strategy("tp").check_model(_meta(), 4, cfg)
    with pytest.raises(ConfigError, match="has 4 stages but the model has 3 layers"):
        get_strategy("pp").check_model(_meta(n_layers=3), 4, StrategyConfig(name="pp"))
    interleaved = StrategyConfig(name="pp", pp_schedule="interleaved-1f1b")
    with pytest.raises(ConfigError, match="has 6 stages but the model has 4 layers"):  # 2 stages per rank
        get_strategy("pp").check_model(_meta(n_layers=4), 3, interleaved)
    with pytest.raises(ConfigError, match="tie_embeddings"):
        check_pipeline(_meta(tie_embeddings=True), 2)  # type: ignore[arg-type]


def test_split_layers_even_uneven_and_explicit() -> None:
    assert split_layers(10, 4) == [["0", "1", "2"], ["3", "4", "5"], ["6", "7"], ["8", "9"]]
    assert split_layers(4, 3) == [["0", "1"], ["2"], ["3"]]
    assert split_layers(6, 2, [2, 4]) == [["0", "1"], ["2", "3", "4", "5"]]
    with pytest.raises(ConfigError, match="sum to the model's 6 layers"):
        split_layers(6, 2, [2, 3])


def test_stages_share_modules_and_keep_names() -> None:
    model = _meta(n_layers=4)
    stages = [pipeline_split(model, 3, s) for s in range(3)]  # type: ignore[arg-type]
    names = [[n for n, _ in s.named_parameters()] for s in stages]
    assert names[0][0] == "tok_embeddings.weight" and names[0][-1].startswith("layers.1.")
    assert all(n.startswith("layers.2.") for n in names[1])
    assert names[2][0].startswith("layers.3.") and names[2][-2:] == ["norm.weight", "output.weight"]
    full = dict(model.named_parameters())
    assert sorted(n for ns in names for n in ns) == sorted(full)  # every parameter on exactly one stage
    assert all(p is full[n] for s in stages for n, p in s.named_parameters())  # shared, not copied


def test_tp_plan_names_only_the_modules_present() -> None:
    model = _meta(n_layers=2)
    plan = tp_plan(model)  # type: ignore[arg-type]
    assert {"tok_embeddings", "norm", "output", "layers.1.attention.wq", "layers.1.attention"} <= set(plan)
    assert "layers.0.attention_norm" in plan
    no_sp = tp_plan(model, sequence_parallel=False)  # type: ignore[arg-type]
    assert "norm" not in no_sp and "layers.0.attention" not in no_sp
    last = tp_plan(pipeline_split(model, 2, 1))  # type: ignore[arg-type]
    assert "tok_embeddings" not in last and "layers.0.attention.wq" not in last and "output" in last
