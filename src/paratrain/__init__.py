"""paratrain: distributed PyTorch training, correct by construction.

    import paratrain
    ctx = paratrain.init()                                   # reads the torchrun environment
    model, optimizer, strategy = paratrain.setup(model, optimizer, strategy="ddp", ctx=ctx)

The names below are imported on first use, so ``paratrain.plan``, ``paratrain.spec`` (pure numbers) and
``paratrain.lint`` (pure source analysis) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("paratrain")  # one version: the package metadata (pyproject.toml)
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "ConfigError": "paratrain.errors",
    "RunConfig": "paratrain.config",
    "Strategy": "paratrain.parallel",
    "Topology": "paratrain.spec",
    "available_strategies": "paratrain.parallel",
    "setup": "paratrain.parallel",
    "Context": "paratrain.runtime",
    "get_logger": "paratrain.runtime",
    "init": "paratrain.runtime",
    "print0": "paratrain.runtime",
    "shutdown": "paratrain.runtime",
    "Trainer": "paratrain.train",
    "load_state": "paratrain.checkpoint.loop",
    "save_state": "paratrain.checkpoint.loop",
}

if TYPE_CHECKING:  # the names, for type checkers and IDEs; at run time __getattr__ imports them
    from paratrain.checkpoint.loop import load_state, save_state  # noqa: F401
    from paratrain.config import RunConfig  # noqa: F401
    from paratrain.errors import ConfigError  # noqa: F401
    from paratrain.parallel import Strategy, available_strategies, setup  # noqa: F401
    from paratrain.runtime import Context, get_logger, init, print0, shutdown  # noqa: F401
    from paratrain.spec import Topology  # noqa: F401
    from paratrain.train import Trainer  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
