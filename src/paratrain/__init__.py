"""paratrain: distributed PyTorch training, correct by construction.

import paratrain
ctx = paratrain.init()                                   # reads the torchrun environment
model, optimizer, strategy = paratrain.setup(model, optimizer, strategy="ddp", ctx=ctx)
"""

from paratrain.config import ConfigError, RunConfig
from paratrain.parallel import Strategy, available_strategies, setup
from paratrain.runtime import Context, get_logger, init, print0, shutdown
from paratrain.train import Trainer

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Context",
    "RunConfig",
    "Strategy",
    "Trainer",
    "available_strategies",
    "get_logger",
    "init",
    "print0",
    "setup",
    "shutdown",
]
