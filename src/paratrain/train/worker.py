"""Entry point of every training worker: ``python -m paratrain.train.worker CONFIG_JSON``.

The launcher writes the validated :class:`RunConfig` to a JSON file in the run directory and starts
this module on every rank under the elastic agent. Rank 0 writes ``summary.json`` at the end; the
launching process prints it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from paratrain.config import RunConfig
from paratrain.data import build_dataset
from paratrain.models import build_model, count_parameters
from paratrain.parallel import build_strategy
from paratrain.parallel.parallelize import parallelize
from paratrain.runtime import Context, die_with_launcher, get_logger, init, record_errors, shutdown
from paratrain.train.logs import install_rank_log
from paratrain.train.trainer import Trainer, TrainResult, build_optimizer


def build_trainer(cfg: RunConfig, ctx: Context, run_dir: Path) -> Trainer:
    """Build data, model, optimizer and strategy from ``cfg``: everything :meth:`Trainer.fit` needs."""
    data = build_dataset(cfg.data, cfg.train.seed)
    model = build_model(cfg.model, data.input_shape, data.num_outputs)
    num_params = count_parameters(model)
    strategy = build_strategy(ctx, cfg.strategy)  # the run's topology and its one DeviceMesh
    # TP -> SyncBatchNorm -> activation checkpointing -> compile -> optimizer -> FSDP/replication
    model, optimizer = parallelize(model, strategy, lambda m: build_optimizer(m, cfg), cfg, get_logger(ctx))
    return Trainer(cfg, ctx, model, optimizer, strategy, data, num_params, run_dir)


def train(cfg: RunConfig, ctx: Context, run_dir: Path) -> TrainResult:
    """Build everything from ``cfg`` and train on this rank."""
    return build_trainer(cfg, ctx, run_dir).fit()


@record_errors
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    config_path = Path(argv[0])
    die_with_launcher()  # a SIGKILLed launcher must not leave this worker training on
    cfg = RunConfig.from_json(config_path.read_text())
    run_dir = config_path.parent
    ctx = init(cfg.launch.backend, cfg.launch.device, cfg.launch.timeout_s, cfg.train.seed)
    install_rank_log(ctx, run_dir)  # RUN_DIR/logs/rank{r}.log: log lines, stderr, the uncaught error
    # start-up is done: Ctrl-C raises KeyboardInterrupt again, so the finally blocks below clean up
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = train(cfg, ctx, run_dir)
        if ctx.is_main:
            (run_dir / "summary.json").write_text(json.dumps(result.summary()))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
    # The run is complete (summary written, process groups destroyed). Skip interpreter finalization:
    # Gloo's C++ worker threads can still hold work objects with tensors whose destruction needs the GIL
    # while the interpreter is being torn down, which occasionally aborts the process (SIGABRT,
    # "terminate called without an active exception"; see pytorch/pytorch#179291) and would turn a
    # finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
