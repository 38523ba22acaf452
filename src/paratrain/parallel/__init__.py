"""Parallel strategies over one topology per run.

- :mod:`.registry`: the strategy registry (``@register_strategy``, :func:`get_strategy`);
- :mod:`.strategy`: the base class the trainer talks to;
- :mod:`.topology`: ``Topology`` and the run's DeviceMesh;
- :mod:`.parallelize`: TP -> SyncBatchNorm -> activation checkpointing -> compile -> FSDP/replication;
- one module per strategy, its communication schedule in its docstring: :mod:`.ddp`, :mod:`.bucketed`
  (``dp``), :mod:`.zero` (``zero1``/``zero2``), :mod:`.fsdp` (``zero3``/``hsdp``), :mod:`.single`,
  :mod:`.tensor` (``tp``/``fsdp+tp``), :mod:`.pipeline` (``pp``/``fsdp+pp``/``fsdp+tp+pp``), :mod:`.expert` (``ep``/``fsdp+ep``/``fsdp+tp+ep``),
  :mod:`.expert_pipeline` (``fsdp+ep+pp``);
- :mod:`.layers` (SyncBatchNorm), :mod:`.optim` (optimizer rebinding), :mod:`.memory` (bytes held),
  :mod:`.grads` (DTensor gradients: layout, replica averaging, global norm).
"""

from paratrain.parallel import (  # noqa: F401  (register)
    bucketed,
    ddp,
    expert,
    expert_pipeline,
    fsdp,
    pipeline,
    single,
    tensor,
    zero,
)
from paratrain.parallel.api import Prepared, build_strategy, setup
from paratrain.parallel.memory import model_state_bytes
from paratrain.parallel.optim import canonical_name, clone_optimizer, parameter_names, rebind_optimizer
from paratrain.parallel.registry import (
    available_strategies,
    check_strategy,
    get_strategy,
    register_strategy,
    strategy_aliases,
)
from paratrain.parallel.strategy import Strategy
from paratrain.parallel.topology import AXES, Topology

__all__ = [
    "AXES",
    "Prepared",
    "Strategy",
    "Topology",
    "available_strategies",
    "build_strategy",
    "canonical_name",
    "check_strategy",
    "clone_optimizer",
    "get_strategy",
    "model_state_bytes",
    "parameter_names",
    "rebind_optimizer",
    "register_strategy",
    "setup",
    "strategy_aliases",
]
