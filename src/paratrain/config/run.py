""":class:`RunConfig`: every section of one run; built from TOML, JSON, ``--set`` and checked across sections."""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratrain.config.convert import convert
from paratrain.config.job import CheckpointConfig, LaunchConfig, TrainConfig
from paratrain.config.sections import DataConfig, ModelConfig, OptimizerConfig, StrategyConfig
from paratrain.errors import ConfigError, suggest


@dataclass
class RunConfig:
    """Everything one ``paratrain train`` run needs, in sections mirroring the components."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> RunConfig:
        """Build from nested ``{section: {key: value}}``; unknown sections or keys are errors."""
        sections = section_types()
        kwargs: dict[str, Any] = {}
        for sec_name, values in data.items():
            if sec_name not in sections:
                raise ConfigError(f"{source}: unknown section [{sec_name}]. {suggest(sec_name, sections)}")
            if not isinstance(values, Mapping):
                raise ConfigError(f"{source}: [{sec_name}] must be a table of key = value pairs.")
            kwargs[sec_name] = build_section(sections[sec_name], sec_name, values, source)
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {str(p)!r} does not exist. Pass an existing TOML file to --config."
            )
        try:
            data = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        return cls.from_dict(data, source=str(p))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(json.loads(text), source="config json")

    def override(self, assignments: Sequence[str]) -> RunConfig:
        """Apply ``section.key=value`` strings; values are converted to the field's declared type."""
        data = self.to_dict()
        sections = section_types()
        for item in assignments:
            if "=" not in item:
                raise ConfigError(f"--set {item!r}: write section.key=value, e.g. --set optimizer.lr=0.01")
            path, raw = item.split("=", 1)
            if "." not in path:
                raise ConfigError(f"--set {item!r}: the key must be section.key, e.g. train.steps")
            sec, key = path.strip().split(".", 1)
            if sec not in sections:
                raise ConfigError(f"--set {item!r}: unknown section {sec!r}. {suggest(sec, sections)}")
            hints = typing.get_type_hints(sections[sec])
            if key not in hints:
                raise ConfigError(f"--set {item!r}: unknown key {sec}.{key}. {suggest(key, hints)}")
            data[sec][key] = convert(raw.strip(), hints[key], f"{sec}.{key}")
        return RunConfig.from_dict(data, source="--set")

    # ---- cross-section validation -----------------------------------------------------------------
    def validate(self, world_size: int, data_parallel_size: int | None = None) -> None:
        """Checks that need the world size. Raises :class:`ConfigError`."""
        dp = data_parallel_size if data_parallel_size is not None else world_size
        per_step = dp * self.train.grad_accum
        if self.train.batch_size % dp == 0 and self.train.batch_size % per_step != 0:
            per_rank, k = self.train.batch_size // dp, self.train.grad_accum
            raise ConfigError(
                f"--grad-accum {k} does not divide the per-rank batch {per_rank} (global batch "
                f"{self.train.batch_size} / {dp} data-parallel ranks): each micro-batch must hold the same "
                f"number of samples. Use a --grad-accum that divides {per_rank}, or a --batch-size that is a "
                f"multiple of {per_step}."
            )
        if self.train.batch_size % per_step != 0:
            fix = f"e.g. --batch-size {max(per_step, self.train.batch_size // per_step * per_step)}"
            if per_step > self.train.batch_size:  # more ranks than samples: fewer processes is the real fix
                fits = [
                    d for d in range(1, dp + 1) if self.train.batch_size % (d * self.train.grad_accum) == 0
                ]
                fix = (
                    f"or, more likely, fewer processes: {dp} data-parallel ranks cannot share a global batch of "
                    f"{self.train.batch_size} (--nproc-per-node {max(fits)} would, or a --batch-size of at "
                    f"least {per_step})"
                )
            raise ConfigError(
                f"train.batch_size={self.train.batch_size} (global) is not divisible by data-parallel size "
                f"{dp} x grad_accum {self.train.grad_accum} = {per_step}. Use a multiple of {per_step}, {fix}."
            )


def section_types() -> dict[str, type]:
    return {f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)}


def build_section(cls: type, sec: str, values: Mapping[str, Any], source: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{source}: unknown key {sec}.{key}. {suggest(key, hints)}")
        kwargs[key] = convert(value, hints[key], f"{sec}.{key}")
    return cls(**kwargs)
