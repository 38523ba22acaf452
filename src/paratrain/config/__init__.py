"""Typed configuration: one dataclass per component, TOML files, ``--set section.key=value`` overrides.

Each option is declared once, in this package: a dataclass field with a docstring underneath it (torchtitan's
convention). The field's ``option(...)`` metadata says whether it is also a command-line flag, and under
which name; :func:`add_arguments` generates the argparse flags from the fields, with the docstrings as
help, and :func:`apply_arguments` writes what the user passed back into the config. One converter
(:func:`convert`) turns TOML values, JSON values and command-line strings into the declared types.

Every dataclass checks its own fields in ``__post_init__``. Checks that need several sections or the
world size live in :meth:`RunConfig.validate`. Names that live in a registry (strategy, model, dataset)
are refused by the registries themselves, in the launching process, before any worker starts: this
package imports no registry.

The package: :mod:`.fields` (declaring and checking a field), :mod:`.sections` and :mod:`.job` (the
sections), :mod:`.run` (:class:`RunConfig`), :mod:`.commands` (the configs of commands other than a run),
:mod:`.convert` (the one converter), :mod:`.cli` (generated flags).
"""

from paratrain.config.cli import (
    CliOption,
    add_arguments,
    add_command_arguments,
    add_set_argument,
    apply_arguments,
    cli_options,
    command_config,
    command_options,
    field_docs,
    iter_options,
    set_values,
)
from paratrain.config.commands import GenerateConfig
from paratrain.config.convert import convert
from paratrain.config.fields import (
    AC_MODES,
    BOTH,
    COMM_ALGORITHMS,
    LAUNCH,
    TRACKERS,
    TRAIN,
    ac_policy,
    choice,
    option,
)
from paratrain.config.job import (
    CheckpointConfig,
    LaunchConfig,
    TrainConfig,
)
from paratrain.config.run import RunConfig
from paratrain.config.sections import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    StrategyConfig,
)
from paratrain.errors import ConfigError

__all__ = [
    "AC_MODES",
    "BOTH",
    "COMM_ALGORITHMS",
    "LAUNCH",
    "TRACKERS",
    "TRAIN",
    "CheckpointConfig",
    "CliOption",
    "ConfigError",
    "DataConfig",
    "GenerateConfig",
    "LaunchConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "StrategyConfig",
    "TrainConfig",
    "ac_policy",
    "add_arguments",
    "add_command_arguments",
    "add_set_argument",
    "apply_arguments",
    "choice",
    "cli_options",
    "command_config",
    "command_options",
    "convert",
    "field_docs",
    "iter_options",
    "option",
    "set_values",
]
