"""Process runtime: this process's :class:`Context` and ``init()`` (:mod:`.context`), the launcher watch and
clean exit (:mod:`.process`), the logger (:mod:`.logger`), and the error records of a failed worker
(:mod:`.failures`)."""

from paratrain.runtime.context import (
    Context,
    choose_backend,
    cuda_available,
    device_synchronizer,
    init,
    seed_everything,
    synchronize,
)
from paratrain.runtime.failures import NO_RESTART_ENV, _write_error_file, record_errors
from paratrain.runtime.logger import get_logger, log, print0
from paratrain.runtime.process import (
    EXIT_GRACE_S,
    STORE_TRY_S,
    attempt,
    attempt_key,
    die_with_launcher,
    install_exit_grace,
    launcher_gone,
    shutdown,
)

__all__ = [
    "EXIT_GRACE_S",
    "NO_RESTART_ENV",
    "STORE_TRY_S",
    "Context",
    "_write_error_file",
    "attempt",
    "attempt_key",
    "choose_backend",
    "cuda_available",
    "device_synchronizer",
    "die_with_launcher",
    "get_logger",
    "init",
    "install_exit_grace",
    "launcher_gone",
    "log",
    "print0",
    "record_errors",
    "seed_everything",
    "shutdown",
    "synchronize",
]
