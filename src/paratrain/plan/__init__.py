"""The memory / communication / step-time planner: pure computation, no process group, no GPU.

See docs/plan.md. Entry points: :func:`plan` (one model × layouts × batch × cluster → the JSON of
``paratrain plan --json``), :func:`recommend`, :func:`sweep`; the CLI in :mod:`paratrain.plan.cli`.
"""

from __future__ import annotations

from paratrain.plan.api import Workload, evaluate, plan
from paratrain.plan.layout import Layout
from paratrain.plan.model import (
    ModelSpec,
    TransformerShape,
    shape_from_config,
    spec_from_module,
    spec_from_params,
    spec_from_shape,
)
from paratrain.spec.hardware import PRESETS, Cluster, calibrate, preset

__all__ = [
    "PRESETS",
    "Cluster",
    "Layout",
    "ModelSpec",
    "TransformerShape",
    "Workload",
    "calibrate",
    "evaluate",
    "plan",
    "preset",
    "shape_from_config",
    "spec_from_module",
    "spec_from_params",
    "spec_from_shape",
]
