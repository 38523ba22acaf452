"""The guard inside one worker: the patches, installed before the user's script runs.

Patched at the narrowest points, all public API:

- ``torch.distributed.init_process_group``: after it returns, the rank and world size go into the record
  and, in store mode, the watcher starts publishing (:mod:`watch`);
- the collectives (:mod:`recorder`);
- ``DistributedDataParallel.__init__``, ``fully_shard`` and ``nn.DataParallel.__init__``: the wrapped model
  is remembered (for the desync check) and gets a forward pre-hook (progress, and the first-forward data
  and placement checks of :mod:`checks`);
- ``torch.optim.optimizer.register_optimizer_step_post_hook`` (a global hook, no patch): the step counter
  and, every K steps of the first optimizer that steps, :func:`desync.compare`;
- ``torch.nn.modules.module.register_module_forward_pre_hook`` (global, removed at the first optimizer
  step): the modules that ran a forward before it, so that a model no wrapper saw (a hand-written gradient
  all-reduce) is still compared by parameter name, not by optimizer index;
- ``DistributedSampler.__iter__``: the order of each epoch, for ``no-set-epoch`` (``set_epoch``: whether
  the script advances the epoch at all).
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paratrain.diagnose.guard import checks, desync
from paratrain.diagnose.guard.record import RecordWriter
from paratrain.diagnose.guard.recorder import Recorder, unrecorded
from paratrain.diagnose.guard.watch import Watcher


class Guard:
    def __init__(
        self, guard_dir: str | None, hang_timeout: float, desync_every: int, store_mode: bool | None = None
    ) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.guard_dir = guard_dir
        self.hang_timeout = hang_timeout
        self.desync_every = desync_every
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world)))
        # One launcher sees every rank's file only on a single node; otherwise the store carries the records.
        self.store_mode = (
            store_mode if store_mode is not None else (guard_dir is None or local_world < self.world)
        )
        path = os.path.join(guard_dir, f"rank{self.rank}.rec") if guard_dir else None
        self.writer = RecordWriter(path, self.rank, self.world)
        self.recorder = Recorder(self.writer)
        self.watcher = Watcher(self.writer, self.recorder.sites)
        self.models: list[weakref.ref[torch.nn.Module]] = []
        self._checked: set[int] = set()
        self._optimizer: weakref.ref[Any] | None = None
        self.steps = 0
        self.desync_checks = 0
        """Replica comparisons made (each one compares every parameter and buffer across the ranks)."""
        self.inputs_pending = False
        """Rank 0: a first forward happened and the ranks' inputs are still to be compared."""
        self.last_ok: int | None = None
        self._undo: list[Callable[[], None]] = []
        self._seen: dict[int, weakref.ref[torch.nn.Module]] = {}
        """Modules that ran a forward before the first optimizer step (until then only)."""
        self._stop_seeing: Callable[[], None] | None = None
        self.unwrapped: list[weakref.ref[torch.nn.Module]] = []
        """The outermost modules seen that hold the stepping optimizer's parameters (no wrapper seen)."""

    # -- install ---------------------------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def install(self) -> None:
        import torch.distributed.distributed_c10d as c10d
        from torch.nn.parallel import DistributedDataParallel
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.utils.data.distributed import DistributedSampler

        self.recorder.install()
        self._undo.append(self.recorder.uninstall)
        original_init = c10d.init_process_group
        wrapped_init = self._wrap_init(original_init)
        for module in (dist, c10d):
            if getattr(module, "init_process_group", None) is original_init:
                self._patch(module, "init_process_group", lambda _f: wrapped_init)
        self._patch(DistributedDataParallel, "__init__", lambda f: self._wrap_ctor(f, "DDP"))
        self._patch(torch.nn.DataParallel, "__init__", lambda f: self._wrap_ctor(f, "DataParallel"))
        self._patch_fully_shard()
        self._patch(DistributedSampler, "__iter__", self._wrap_sampler_iter)
        self._patch(DistributedSampler, "set_epoch", self._wrap_set_epoch)
        handle = register_optimizer_step_post_hook(self._after_step)
        self._undo.append(handle.remove)
        seen = torch.nn.modules.module.register_module_forward_pre_hook(self._seen_forward)
        self._stop_seeing = seen.remove
        self._undo.append(self._end_seeing)
        self.watcher.start()
        self._undo.append(self.watcher.stop)

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _patch_fully_shard(self) -> None:
        try:
            import torch.distributed.fsdp as fsdp
            import torch.distributed.fsdp._fully_shard._fully_shard as impl
        except ImportError:  # pragma: no cover - torch without FSDP2
            return
        original = impl.fully_shard
        guard = self

        @functools.wraps(original)
        def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(module, *args, **kwargs)
            for m in out if isinstance(out, list | tuple) else [out]:
                if isinstance(m, torch.nn.Module):
                    guard.remember(m)
            return out

        # every module that exports it (the public path, the implementation, the older composable path)
        names = ("torch.distributed.fsdp._fully_shard", "torch.distributed._composable.fsdp")
        for mod in (fsdp, impl, *(sys.modules.get(n) for n in names)):
            if mod is not None and getattr(mod, "fully_shard", None) is original:
                self._patch(mod, "fully_shard", lambda _f: fully_shard)

    # -- wrappers -------------------------------------------------------------------------------------------
    def _wrap_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.writer.set_identity(self.rank, self.world)
            if self.store_mode and self.world > 1:
                store = dist.distributed_c10d._get_default_store()
                self.watcher.use_store(store, self.rank, self.world, self.hang_timeout, self.report)
            return out

        return init_process_group

    def _wrap_ctor(self, original: Callable[..., Any], kind: str) -> Callable[..., Any]:
        guard = self

        @functools.wraps(original)
        def __init__(wrapper: Any, module: Any, *args: Any, **kwargs: Any) -> None:
            try:
                checks.at_wrap(module, kind)
            except Exception as e:  # a check must never break the user's script
                guard.note(f"check at {kind} construction skipped: {e}")
            original(wrapper, module, *args, **kwargs)
            if kind == "DDP":
                guard.remember(wrapper)

        return __init__

    def _wrap_sampler_iter(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def __iter__(sampler: Any) -> Any:
            indices = list(original(sampler))
            checks.sampler_order(sampler, indices)
            return iter(indices)

        return __iter__

    def _wrap_set_epoch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def set_epoch(sampler: Any, epoch: int) -> None:
            sampler._paratrain_guard_set_epoch = True  # the script advances epochs: no-set-epoch is moot
            original(sampler, epoch)

        return set_epoch

    # -- models, forward, step ------------------------------------------------------------------------------
    def remember(self, model: torch.nn.Module) -> None:
        if any(ref() is model for ref in self.models):
            return
        self.models.append(weakref.ref(model))
        handle = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        self._undo.append(handle.remove)

    def roots(self) -> list[torch.nn.Module]:
        alive = [m for ref in self.models if (m := ref()) is not None]
        inner = {id(sub) for m in alive for sub in list(m.modules())[1:]}
        return [m for m in alive if id(m) not in inner]

    def _pre_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        self.writer.tick()
        if id(module) in self._checked:
            return
        self._checked.add(id(module))
        if not any(r is module for r in self.roots()):
            return
        try:
            checks.at_first_forward(getattr(module, "module", module), args, kwargs)
            self.inputs_pending = self.rank == 0
        except Exception as e:
            self.note(f"first-forward checks skipped: {e}")

    def _seen_forward(self, module: torch.nn.Module, args: Any) -> None:
        if id(module) not in self._seen:
            self._seen[id(module)] = weakref.ref(module)

    def _end_seeing(self) -> None:
        if self._stop_seeing is not None:
            self._stop_seeing()
            self._stop_seeing = None
        self._seen.clear()

    def _find_unwrapped(self, optimizer: Any) -> None:
        """At the first step: the outermost modules that ran a forward and hold the optimizer's parameters."""
        alive = [m for ref in self._seen.values() if (m := ref()) is not None]
        self._end_seeing()
        inner = {id(sub) for m in alive for sub in list(m.modules())[1:]}
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.unwrapped = [
            weakref.ref(m)
            for m in alive
            if id(m) not in inner and any(id(p) in stepped for p in m.parameters())
        ]

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._optimizer is None:
            self._optimizer = weakref.ref(optimizer)
            try:
                self._find_unwrapped(optimizer)
            except Exception as e:  # a check must never break the user's script
                self._end_seeing()
                self.note(f"model discovery skipped: {e}")
        if self._optimizer() is not optimizer:
            return
        self.steps += 1
        self.writer.tick(self.steps)
        self.compare_inputs()
        if self.desync_every > 0 and self.steps % self.desync_every == 0 and dist.is_initialized():
            self.check_desync(optimizer)

    def compare_inputs(self) -> None:
        if self.inputs_pending:
            try:
                self.inputs_pending = not checks.compare_inputs()
            except Exception as e:
                self.inputs_pending = False
                self.note(f"input comparison skipped: {e}")

    def check_desync(self, optimizer: Any = None) -> None:
        """Compare the remembered models (wrapped ones, else the unwrapped models found at the first step,
        else the optimizer's parameters by index); raises DesyncError."""
        roots = self.roots() or [m for ref in self.unwrapped if (m := ref()) is not None]
        named: list[tuple[str, torch.Tensor]] = []
        for i, model in enumerate(roots):
            prefix = f"model{i}." if len(roots) > 1 else ""
            for label, t in desync.named_state(model):
                kind, name = label.split(" ", 1)
                named.append((f"{kind} {prefix}{name}", t))
        if not named and optimizer is not None:
            for g, group in enumerate(optimizer.param_groups):
                for i, p in enumerate(group["params"]):
                    dtype, shape = str(p.dtype).removeprefix("torch."), ",".join(map(str, p.shape))
                    named.append((f"parameter param_groups[{g}][{i}] ({dtype}[{shape}])", p))
        desync.compare(named, self.steps, None, self.last_ok, unrecorded=unrecorded)
        self.desync_checks += 1
        self.last_ok = self.steps

    # -- reporting ------------------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        sys.stderr.write(f"paratrain guard: rank {self.rank}: {text}\n")
        sys.stderr.flush()

    def report(self, message: str) -> None:
        """A fatal finding: printed once per job, and left in the guard directory for the launcher."""
        if not checks.once("fatal"):
            return
        sys.stderr.write(f"paratrain guard: {message}\n")
        sys.stderr.flush()
        if self.guard_dir:
            try:
                fd = os.open(
                    os.path.join(self.guard_dir, "finding"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
                )
                with os.fdopen(fd, "w") as f:
                    f.write(message + "\n")
            except OSError:
                pass
