"""The one description of a run, torch-free: its topology, every strategy name, the hardware, the cost model.

- :mod:`.topology`: :class:`Topology` (degrees, axis order, strides); the DeviceMesh is built in
  :mod:`paratrain.parallel.topology`;
- :mod:`.strategies`: one :class:`StrategySpec` per strategy name (aliases, presets, capabilities) and the
  only place presets and refusals are decided (:func:`resolve`, :func:`check`);
- :mod:`.hardware`: GPU peak FLOP/s and memory, cluster presets, calibration from measured runs;
- :mod:`.cost`: the α–β cost model of every collective algorithm and nccl-tests' bandwidth formulas.

Nothing in this package imports torch: the launcher, the planner, ``paratrain strategies`` and ``paratrain
lint`` read it without paying torch's import time.
"""

from paratrain.spec.presets import resolve
from paratrain.spec.refusals import check
from paratrain.spec.strategies import STRATEGIES, StrategySpec
from paratrain.spec.topology import AXES, Topology

__all__ = ["AXES", "STRATEGIES", "StrategySpec", "Topology", "check", "resolve"]
