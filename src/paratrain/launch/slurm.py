"""Slurm: detect an allocation and fill in the multi-node launch; print a ready ``sbatch`` script.

Inside an allocation (``srun`` sets ``SLURM_JOB_ID``, ``SLURM_NNODES``, ``SLURM_NODEID``,
``SLURM_JOB_NODELIST``), a multi-node launch needs no flags: the number of nodes, this node's rank, the
rendezvous endpoint (first host of the node list, port 29500 unless given) and the job id as rendezvous
id are filled in. One ``paratrain`` agent runs per node (``--ntasks-per-node=1``); it starts one worker
per GPU. Flags given explicitly always win.

Reference: https://slurm.schedmd.com/sbatch.html, https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from paratrain.config import LaunchConfig
from paratrain.errors import ConfigError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class SlurmEnv:
    job_id: str
    nnodes: int
    node_rank: int
    nodes: list[str]
    gpus_per_node: int | None

    @property
    def master_addr(self) -> str:
        return self.nodes[0]


def expand_nodelist(spec: str) -> list[str]:
    """Expand Slurm's compressed host list: ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)(?:,|$)", spec.strip()):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not prefix and not ranges:
            continue
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{part}{suffix}")
    return hosts


def _gpus(env: Mapping[str, str]) -> int | None:
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(key, "")
        digits = re.findall(r"\d+", value.split(":")[-1]) if value else []
        if digits:
            return int(digits[-1])
    return None


def detect(env: Mapping[str, str] | None = None) -> SlurmEnv | None:
    """The allocation this process runs in (``None`` outside Slurm, or in a batch shell outside ``srun``)."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or "SLURM_NODEID" not in env:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    nodes = expand_nodelist(nodelist) if nodelist else []
    nnodes = int(
        env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1
    )
    if not nodes:
        return None
    return SlurmEnv(env["SLURM_JOB_ID"], nnodes, int(env["SLURM_NODEID"]), nodes, _gpus(env))


def apply(launch: LaunchConfig, env: Mapping[str, str] | None = None) -> LaunchConfig:
    """``launch`` with Slurm's values filled in where the user gave none (multi-node allocations only)."""
    s = detect(env)
    if s is None or s.nnodes < 2 or launch.rdzv_endpoint is not None or launch.nnodes != "1":
        return launch
    return replace(
        launch,
        nnodes=str(s.nnodes),
        node_rank=s.node_rank,
        rdzv_endpoint=f"{s.master_addr}:{launch.master_port or DEFAULT_PORT}",
        rdzv_id=launch.rdzv_id or f"slurm-{s.job_id}",
        nproc_per_node=launch.nproc_per_node or s.gpus_per_node,
    )


_SET_BY_SCRIPT = {
    "nproc_per_node": "--gpus-per-node",
    "nnodes": "--nodes",
    "node_rank": None,
    "rdzv_endpoint": None,
    "rdzv_id": None,
    "rdzv_backend": None,
    "master_port": None,
}
"""Launch flags the sbatch script sets itself (from the allocation, or from the --slurm flag named)."""


def srun_flags(given: Mapping[str, Any], guard: Sequence[str] = ()) -> list[str]:
    """The agent's flags for the script's ``srun`` line, from the launch options the user gave
    (``{key: value}``, keys of :class:`LaunchConfig`; ``max_restarts`` is :func:`sbatch_script`'s own)
    and the guard flags. A flag the script sets itself is refused, naming what to use instead: silently
    dropping it would run a different job than the one asked for."""
    for key, value in given.items():
        if key in _SET_BY_SCRIPT:
            flag = "--" + key.replace("_", "-")
            instead = _SET_BY_SCRIPT[key]
            how = f"give {instead} instead" if instead else "leave it out"
            raise ConfigError(
                f"--slurm with {flag} {value}: the sbatch script sets {flag} itself from the allocation; {how}."
            )
    out = list(guard)
    for key in ("rdzv_conf", "cpu_bind", "device"):
        if given.get(key) is not None:
            out += ["--" + key.replace("_", "-"), str(given[key])]
    return out


def sbatch_script(
    nodes: int,
    gpus_per_node: int,
    command: list[str],
    job_name: str = "paratrain",
    time_limit: str = "01:00:00",
    port: int = DEFAULT_PORT,
    max_restarts: int = 3,
    partition: str | None = None,
    flags: Sequence[str] = (),
) -> str:
    """A complete ``sbatch`` script running ``paratrain launch ... COMMAND`` on ``nodes`` nodes; ``flags``
    (from :func:`srun_flags`) go to the agent on every node."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes and --gpus-per-node must be >= 1 (got {nodes}, {gpus_per_node}).")
    if not command:
        raise ConfigError(
            "give the script to run after the launch flags, e.g. `paratrain launch --slurm ... train.py`"
        )
    part = f"#SBATCH --partition={partition}\n" if partition else ""
    cmd = " ".join(shlex.quote(c) for c in command)
    if command[0] == "train" and not os.path.isfile("train"):
        # `paratrain train ...`: the agent is paratrain train itself (it writes the config, then launches).
        launcher, cmd = "paratrain train", " ".join(shlex.quote(c) for c in command[1:])
    else:
        launcher = "paratrain launch"
    backend_line = "" if launcher == "paratrain train" else "    --rdzv-backend c10d \\\n"
    if launcher == "paratrain train" and any(f.startswith(("--guard", "--hang-timeout")) for f in flags):
        raise ConfigError(
            "--slurm ... train with --guard: --guard checks a script; paratrain train has its own checks "
            "(e.g. --check-desync-every K). Put train's flags after `train`."
        )
    extra = "".join(f"    {shlex.quote(a)} {shlex.quote(b)} \\\n" if b is not None else f"    {a} \\\n"
                    for a, b in _pairs(flags))  # fmt: skip
    return f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --cpus-per-task={8 * gpus_per_node}
#SBATCH --time={time_limit}
#SBATCH --signal=USR1@120
{part}#SBATCH --output=%x-%j.out
# One paratrain agent per node (ntasks-per-node=1) starts one worker per GPU.
# --signal=USR1@120: two minutes before the time limit every worker gets SIGUSR1 (forwarded by the agent),
# saves a checkpoint at the same step and stops; resubmitting this script resumes from it.
set -euo pipefail

# Rendezvous on the first node of the allocation. Its port must be reachable from the other nodes but
# must NOT be reachable from outside the cluster: the c10d store accepts any client that connects.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT={port}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-8}}

srun --kill-on-bad-exit=1 {launcher} \\
    --nnodes "$SLURM_NNODES" \\
    --nproc-per-node {gpus_per_node} \\
{backend_line}    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\
    --rdzv-id "slurm-$SLURM_JOB_ID" \\
    --max-restarts {max_restarts} \\
{extra}    {cmd}
"""


def _pairs(flags: Sequence[str]) -> list[tuple[str, str | None]]:
    """``["--a", "1", "--b", "--c", "x"]`` as ``[("--a", "1"), ("--b", None), ("--c", "x")]``."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out.append((flags[i], flags[i + 1]))
            i += 2
        else:
            out.append((flags[i], None))
            i += 1
    return out
