"""``peak_bytes_per_rank``: the live bytes of one training step, measured while it runs.

``model_state_bytes`` (:mod:`paratrain.parallel.memory`) counts what a rank holds *at rest*, after
``optimizer.step()``. A step needs more at its peak: activations kept for backward, gradients before they
are reduced, zero1/zero2's full-size send buffers, FSDP's unsharded units. PyTorch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``, a ``TorchDispatchMode``) follows every tensor storage created
during the step, plus the parameters, gradients and optimizer state registered with ``track_external``,
and records the peak of their sum per device. It runs on CPU and GPU alike.

What it cannot see: storage allocated outside the dispatcher before the step, such as torch DDP's C++
gradient buckets and ``dp``'s persistent bucket buffers (allocated once, at wrap time). Those are reported
separately by their strategies where known, and are named in docs/train.md.

What it must not count: ``--comm-algorithm shm``'s shared-memory segment. A collective slices views of
the segment inside the step, and the tracker would count the whole mapping, every rank's slots and arenas
(about 50 MB on 2 ranks), as this rank's new memory at the first view. The segment's storage is registered
before the step with the bytes that are this rank's own tensors (``dp``'s zero-copy gradient buckets, so
that its gradients count as ``native``'s do) and the rest, transport buffers made once at wrap time like
the backend's own, counts 0 (:func:`paratrain.comm.shm.transport_storages`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from paratrain.comm.shm import transport_storages

T = TypeVar("T")


def measure_peak(
    fn: Callable[[], T],
    model: nn.Module,
    optimizer: Any,
    log: logging.Logger | None = None,
    by_module: bool = True,
) -> tuple[T, int | None]:
    """Run ``fn`` (one training step) under ``MemTracker``; return its result and the peak live bytes on the
    model's device (``None`` when the tracker cannot follow this model, with a log line saying why).
    ``by_module=False``: storages only, no module hooks (a pipeline schedule's order of stage calls)."""
    tracker = _step_tracker(by_module)
    externals: list[Any] = [model]
    for opt in (optimizer, getattr(optimizer, "optim", None)):
        if isinstance(opt, torch.optim.Optimizer):
            externals.append(opt)
    with warnings.catch_warnings():
        # zero1/zero2 free each gradient in a post-accumulate hook once it is reduce-scattered; MemTracker's own
        # hook, which runs after it, then reads ``p.grad is None`` and warns on every rank of every run. The
        # freed gradient is not memory, so the figure is right: only that one warning is dropped, here only.
        warnings.filterwarnings(
            "ignore",
            message=r"Expected a tensor or a traceable wrapper-subclass of tensor, but got <class 'NoneType'>",
            category=UserWarning,
        )
        try:
            register_transport(tracker)
            tracker.track_external(*externals)
            entered = tracker.__enter__()
        except Exception as e:  # a model the tracker cannot register: train on, report no figure
            if log is not None:
                log.warning("peak memory not measured: %s: %s", type(e).__name__, e)
            return fn(), None
        try:
            result = fn()
        finally:
            entered.__exit__(None, None, None)
    peak = tracker.get_tracker_snapshot("peak")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    per_device = {getattr(d, "type", str(d)): v for d, v in peak.items()}
    totals = [int(v.get("Total", 0)) for d, v in peak.items() if getattr(d, "type", None) == device.type]
    if not totals and per_device:
        totals = [int(max(v.get("Total", 0) for v in peak.values()))]
    return result, (max(totals) if totals else None)


def register_transport(tracker: Any, owned: bool = True) -> None:
    """Register each shared-memory transport storage with the tracker before anything else sees it,
    counted as only the bytes that are this rank's tensors, so that views made of it during the step are
    not counted again as the whole mapping. (The tracker keys its records by storage; a view of a known
    storage adds nothing. ``track_external`` of the model then files gradients that live in the segment
    under gradients, with this size.)

    ``owned=False``: the tensors in the segments belong to another model of the process (a benchmark that
    builds several side by side), so nothing of them is counted for the one measured."""
    from torch.distributed._tools.mem_tracker import _MemRefType, _UpdateType, _WeakRefInfo

    for tensor, mine in transport_storages():
        counted = mine if owned else 0
        st = tensor.untyped_storage()
        if st in tracker._WINFO:
            continue
        winfo, ref = _WeakRefInfo.create_winfo(st, tensor.device, _MemRefType.OTH, tracker._delete_callback)
        winfo.mem_consumed = counted  # ``size`` stays the storage's, so the tracker sees no resize
        tracker._WINFO[st] = (winfo, ref)
        if counted > 0:
            tracker._update_snap(_UpdateType.ADD, winfo)


class _NoModules:
    """What ``MemTracker`` asks of its ``ModTracker``, with no module followed: every op runs in the global
    scope, counted as forward (the category of a storage, not its bytes: the peak is the same)."""

    parents = frozenset({"Global"})
    is_bw = False

    def get_known_fqn(self, module: nn.Module) -> str:
        return type(module).__name__

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


def _step_tracker(by_module: bool = True) -> Any:
    """A ``MemTracker`` for one optimizer step of K micro-batches (``--grad-accum K``).

    MemTracker keeps per-module statistics and refuses a root module whose forward runs a second time
    outside backward ("multiple iterative calls"), which is what accumulation does. Only the global peak is
    read here, so the per-module statistics are reset before each micro-batch's root forward; the live
    storages (and so the peak) are tracked across the whole step regardless.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            mods = self._mod_tracker
            root = set(mods.parents) - {mods.get_known_fqn(module)} == {"Global"}
            if module in self.memory_tracking and not mods.is_bw and root:
                self.reset_mod_stats()  # the next micro-batch's forward of the root module
            super()._pre_fw_hook(module, inputs)

    class StorageTracker(MemTracker):
        """Every storage the step creates or the model and optimizer hold, without per-module statistics:
        the module hooks do nothing, the dispatch-level accounting (and so the peak) is MemTracker's own.
        No ``ModTracker`` is entered either: its multi-grad hooks on module inputs fail inside the
        ``autograd.grad`` a pipeline stage runs to infer its gradients' shapes at the first step (an MoE
        stage's expert dispatch passes a leaf to a module), and nothing here reads what it tracks."""

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = _NoModules()  # type: ignore[assignment]

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            pass

        def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
            pass

        def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
            pass

        def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
            pass

    return StepTracker() if by_module else StorageTracker()
