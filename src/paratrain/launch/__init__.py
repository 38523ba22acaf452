"""Starting workers with the real torch elastic agent (``torch.distributed.run``), called from Python.

- :mod:`.agent`: the agent configuration and :func:`run_module` / :func:`run_script` (``paratrain launch``);
- :mod:`.rendezvous`: c10d settings, the loopback-only store of single-node jobs, port checks;
- :mod:`.failures`: one paragraph naming the first failing rank instead of a traceback per rank;
- :mod:`.signals`: SIGTERM/SIGUSR1 forwarded to the workers, which save and stop;
- :mod:`.slurm`: sbatch scripts and values detected inside an allocation;
- :mod:`.train_job`: ``paratrain train``'s checks in the launching process, then its workers.
"""

from paratrain.launch.agent import (
    gpu_count,
    preflight,
    preflight_train,
    resolve,
    resolve_nproc,
    run,
    run_module,
    run_script,
    run_user_module,
    wait_for_summary,
)
from paratrain.launch.failures import LaunchError, RankFailure
from paratrain.launch.rendezvous import LOOPBACK_BACKEND, parse_rdzv_conf, port_in_use

__all__ = [
    "LOOPBACK_BACKEND",
    "LaunchError",
    "RankFailure",
    "gpu_count",
    "parse_rdzv_conf",
    "port_in_use",
    "preflight",
    "preflight_train",
    "resolve",
    "resolve_nproc",
    "run",
    "run_module",
    "run_script",
    "run_user_module",
    "wait_for_summary",
]
