"""This process's place in the job: the torchrun environment, backend and device choice, seeding.

``init()`` is the first thing a worker calls. It reads the environment the elastic agent sets (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), pins the CUDA device from LOCAL_RANK *before* any
CUDA work (otherwise every rank would allocate a context on GPU 0), creates the process group with a
timeout, and seeds every RNG identically. With no torchrun environment it is a world of size 1 and
creates no process group, so the same training code runs in a notebook.

Reference: https://pytorch.org/docs/stable/distributed.html#initialization
"""

from __future__ import annotations

import datetime
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from paratrain.runtime.process import attempt, attempt_key, connect_agent_store, env_int, install_exit_grace


@dataclass(frozen=True)
class Context:
    """Who this process is in the job. Passed explicitly; paratrain keeps no global process-group state."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None
    """``gloo`` / ``nccl``, or ``None`` when no process group exists (world size 1 without torchrun)."""
    timeout_s: float
    restart_count: int = 0
    """How many times the worker group was started before this one, the same on every node
    (:func:`attempt`)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None and dist.is_initialized()

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on CPU): the one place device sync is called."""
        synchronize(self.device)

    def barrier(self) -> None:
        if self.distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def choose_backend(backend: str = "auto", device: str = "auto") -> tuple[str, str]:
    """Resolve ``(backend, device_type)``: NCCL+CUDA when CUDA is present, else Gloo+CPU."""
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise RuntimeError("device 'cuda' was requested but no CUDA GPU is visible. Use --device cpu.")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise RuntimeError("backend 'nccl' needs CUDA devices. Use --backend gloo on CPU.")
    return backend, device


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with the same value."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)  # also seeds all CUDA devices


def init(
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = 300.0,
    seed: int | None = 0,
) -> Context:
    """Initialise this worker and return its :class:`Context`.

    Args:
        backend: ``auto`` (NCCL with CUDA, Gloo otherwise), ``gloo`` or ``nccl``.
        device: ``auto``, ``cpu`` or ``cuda``.
        timeout_s: process-group timeout; a collective that waits longer fails instead of hanging.
        seed: seed for every RNG, identical on all ranks (``None`` leaves the RNGs alone).
    """
    rank = env_int("RANK", 0)
    world_size = env_int("WORLD_SIZE", 1)
    local_rank = env_int("LOCAL_RANK", 0)
    local_world_size = env_int("LOCAL_WORLD_SIZE", 1)
    backend, device_type = choose_backend(backend, device)
    if device_type == "cuda":
        # Pin the device first: any CUDA call before this would create a context on GPU 0 for every rank.
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible: "
                "start at most one process per GPU (--nproc-per-node)."
            )
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")

    use_pg = "MASTER_ADDR" in os.environ and world_size >= 1 and "RANK" in os.environ
    if use_pg and not dist.is_initialized():
        install_exit_grace()
        kwargs: dict[str, Any] = {
            "backend": backend,
            "timeout": datetime.timedelta(seconds=timeout_s),
            "rank": rank,
            "world_size": world_size,
        }
        if device_type == "cuda":
            kwargs["device_id"] = dev  # eager NCCL init bound to this device
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # The agent's store outlives a restart of the worker group, and torch uses it without a
            # per-attempt prefix: a restarted rank would read its peers' addresses from the failed attempt
            # and fail to connect. Prefix every key with this attempt's key, the same on every node.
            client = connect_agent_store(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, timeout_s
            )
            kwargs["store"] = dist.PrefixStore(f"paratrain/attempt_{attempt_key()}", client)
        dist.init_process_group(**kwargs)
    if seed is not None:
        seed_everything(seed)
    return Context(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        device=dev,
        backend=backend if dist.is_initialized() else None,
        timeout_s=timeout_s,
        restart_count=attempt(),
    )


def device_synchronizer(device: torch.device) -> Callable[[], None]:
    """``torch.cuda.synchronize`` on CUDA, a no-op elsewhere (nanochat's one-helper rule)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
