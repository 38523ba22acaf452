"""Config: TOML loading, --set overrides, types and validation messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.config import ConfigError, DataConfig, RunConfig, StrategyConfig, TrainConfig


def test_defaults_are_the_documented_default_workload() -> None:
    cfg = RunConfig()
    assert (cfg.model.name, cfg.data.name, cfg.strategy.name) == ("cnn", "digits", "ddp")
    assert cfg.optimizer.name == "adamw"
    assert cfg.checkpoint.resume == "auto"
    assert cfg.launch.timeout_s < 30 * 60


def test_toml_roundtrip_and_types(tmp_path: Path) -> None:
    p = tmp_path / "run.toml"
    p.write_text(
        '[model]\nname = "mlp"\nhidden = 64\n[train]\nsteps = 5\nbatch_size = 32\n'
        "[optimizer]\nlr = 1\nbetas = [0.8, 0.9]\n"
    )
    cfg = RunConfig.from_toml(p)
    assert cfg.model.name == "mlp" and cfg.model.hidden == 64
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # int widened to float
    assert cfg.optimizer.betas == (0.8, 0.9)
    again = RunConfig.from_json(cfg.to_json())
    assert again == cfg


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[modle]\nname='mlp'\n", "unknown section [modle]"),
        ("[model]\nhiden = 3\n", "unknown key model.hiden"),
        ("[train]\nbatch_size = 'big'\n", "train.batch_size: expected an integer"),
        ("[train]\nbatch_size = 0\n", "train.batch_size must be positive"),
        ("[optimizer]\nname = 'adam'\n", "optimizer.name='adam' is not valid"),
        ("[train]\nprogress = 3\n", "expected true or false"),
        ("not toml ===", "is not valid TOML"),
    ],
)
def test_bad_toml_names_the_problem(tmp_path: Path, toml: str, needle: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError) as e:
        RunConfig.from_toml(p)
    assert needle in str(e.value)


def test_suggests_close_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Did you mean 'hidden'"):
        RunConfig().override(["model.hiden=3"])


def test_missing_config_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig.from_toml(tmp_path / "nope.toml")


def test_set_overrides_parse_by_declared_type() -> None:
    cfg = RunConfig().override(
        [
            "train.steps=7",
            "optimizer.lr=0.5",
            "optimizer.grad_clip=none",
            "train.progress=false",
            "checkpoint.keep_last=2",
            "optimizer.betas=0.5,0.6",
        ]
    )
    assert cfg.train.steps == 7 and cfg.optimizer.lr == 0.5 and cfg.optimizer.grad_clip is None
    assert cfg.train.progress is False and cfg.checkpoint.keep_last == 2
    assert cfg.optimizer.betas == (0.5, 0.6)


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        ("train.steps", "write section.key=value"),
        ("steps=3", "must be section.key"),
        ("trian.steps=3", "unknown section 'trian'"),
        ("train.steps=three", "train.steps: expected an integer, got 'three'"),
        ("train.steps=-1", "train.steps must be positive"),
    ],
)
def test_bad_set_overrides(item: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        RunConfig().override([item])
    assert needle in str(e.value)


def test_dataset_spec_with_path_is_split() -> None:
    d = DataConfig(name="mnist:/data/mnist")
    assert (d.name, d.path) == ("mnist", "/data/mnist")


def test_steps_or_epochs_required() -> None:
    with pytest.raises(ConfigError, match="give train.steps or train.epochs"):
        TrainConfig(steps=None, epochs=None)


def test_validate_global_batch_divisibility_message() -> None:
    cfg = RunConfig().override(["train.batch_size=30", "train.grad_accum=2"])
    with pytest.raises(ConfigError) as e:
        cfg.validate(world_size=4)
    msg = str(e.value)
    assert "not divisible" in msg and "4 x grad_accum 2 = 8" in msg and "--batch-size 24" in msg
    cfg.validate(world_size=3)  # 30 = 3 x 2 x 5: fine


@pytest.mark.parametrize(
    ("lookup", "name", "needle"),
    [
        ("strategy", "zero9", "unknown strategy 'zero9'"),
        ("model", "transformr", "unknown model 'transformr'"),
        ("data", "imagenet", "unknown dataset 'imagenet'"),
    ],
)
def test_registries_refuse_unknown_names(lookup: str, name: str, needle: str) -> None:
    from paratrain.data import get_dataset_builder
    from paratrain.models import get_model_builder
    from paratrain.parallel import get_strategy

    fn = {"strategy": get_strategy, "model": get_model_builder, "data": get_dataset_builder}[lookup]
    with pytest.raises(ConfigError) as e:
        fn(name)
    assert needle in str(e.value) and "Choose one of" in str(e.value)


def test_config_module_imports_no_registry() -> None:
    """config/ sits at the bottom of the import graph: importing it loads no strategy, model or dataset."""
    import subprocess
    import sys

    code = "import sys, paratrain.config; print([m for m in sys.modules if m.startswith('paratrain.') and m != 'paratrain.errors' and m.split('.')[1] != 'config'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_single_strategy_refuses_several_processes() -> None:
    from paratrain.parallel import check_strategy, get_strategy

    with pytest.raises(ConfigError, match="--nproc-per-node 1"):
        check_strategy(get_strategy("single"), 2, StrategyConfig(name="single"))


@pytest.mark.parametrize("nnodes", ["0", "2:1", "a", "1:2:3"])
def test_bad_nnodes(nnodes: str) -> None:
    with pytest.raises(ConfigError, match="launch.nnodes"):
        RunConfig().override([f"launch.nnodes={nnodes}"])


@pytest.mark.parametrize("command", ["train", "plan"])
def test_set_takes_several_values_per_flag_in_train_and_plan(command: str) -> None:
    """``--set a=1 b=2 --set c=3``: every item applies, in train as in plan (a plan command line is a train
    one with the command swapped)."""
    from paratrain.cli import build_config, make_parser
    from paratrain.config import set_values

    argv = [command, "--model", "llama-debug", "--set", "model.dim=48", "model.n_layers=3", "--set",
            "optimizer.lr=0.02", "--batch-size", "4"]  # fmt: skip
    args = make_parser(argv).parse_args(argv)
    assert set_values(args) == ["model.dim=48", "model.n_layers=3", "optimizer.lr=0.02"]
    if command == "train":
        cfg = build_config(args)
        assert (cfg.model.dim, cfg.model.n_layers, cfg.optimizer.lr, cfg.train.batch_size) == (48, 3, 0.02, 4)
