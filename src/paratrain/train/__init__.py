"""Training loop, precision, metrics."""

from paratrain.train.trainer import Trainer, TrainResult, build_optimizer, full_parameters, param_digest

__all__ = ["TrainResult", "Trainer", "build_optimizer", "full_parameters", "param_digest"]
