"""``ddp``: PyTorch's native DistributedDataParallel, configured the way its docs ask.

Communication schedule (done by DDP's C++ reducer): at construction, rank 0's parameters and buffers are
broadcast. During backward, gradients are packed into ``bucket_cap_mb`` buckets in roughly reverse
registration order; each bucket's all-reduce (sum, then divided by world size) is launched asynchronously
as soon as its last gradient is ready, overlapping the rest of backward; ``backward()`` returns after all
buckets finished. With ``forward_sync_buffers=True`` (the 2.13 name of ``broadcast_buffers``) buffers
(BatchNorm running stats) are re-broadcast from rank 0 before every synchronised forward. Inside
``no_sync()`` gradients only accumulate locally.

Configuration, and why:
- the model is on its device before wrapping (DDP registers hooks on, and broadcasts, the tensors it sees);
- ``device_ids=[LOCAL_RANK]`` on GPU (one device per process), ``None`` on CPU, as DDP requires;
- ``bucket_cap_mb``, ``gradient_as_bucket_view`` and ``static_graph`` come from ``[strategy]``;
- ``find_unused_parameters`` is off unless asked for: it walks the autograd graph after every forward.
  Parameters that get no gradient are then reported by name, with the reason (see :class:`_DDP`);
- ``--comm-algorithm shm`` registers a DDP communication hook
  (:func:`paratrain.comm.communicator.ddp_comm_hook`): the reducer still builds and orders the buckets,
  but each bucket's all-reduce goes through one shared-memory segment of the ranks of this host, on a
  worker thread of the hook's state, instead of Gloo's TCP loopback. The gradients then alias the buckets
  (``gradient_as_bucket_view`` on): the hook's all-reduce reads the peers' buckets where they lie, so
  copying every gradient into its bucket and back would be the only copies left. On several nodes the
  hook runs the hierarchical all-reduce: shm inside each node, the backend's all-reduce between them
  (chosen in :mod:`paratrain.comm.communicator`). Other algorithms are refused (they are
  ``dp``'s; torch's reducer only takes a hook).

Reference: https://pytorch.org/docs/stable/notes/ddp.html
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.comm.communicator import ddp_comm_hook
from paratrain.parallel.layers import SyncBatchNorm
from paratrain.parallel.registry import register_strategy
from paratrain.parallel.strategy import Strategy
from paratrain.runtime import get_logger

_UNFINISHED = "Expected to have finished reduction in the prior iteration"


class _DDP(DDP):
    """DDP that names parameters which got no gradient, and says why that matters.

    During the first optimizer step a post-accumulate-grad hook marks each parameter that receives a
    gradient; at the next forward the marks are read once and the hooks removed (no cost afterwards).
    - ``find_unused_parameters=True``: unused parameters work, so they get a warning naming them (they
      still cost memory and a graph walk per step; remove or freeze them and drop the flag).
    - ``find_unused_parameters=False``: DDP's reducer waited for their gradients forever, and the next
      forward fails inside DDP; that error is re-raised naming the parameters and the fix.
    """

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self._got_grad: set[str] = set()
        self._checked = False
        self._forwards = 0
        self._mark_hooks = [
            p.register_post_accumulate_grad_hook(lambda _p, n=n: self._got_grad.add(n))
            for n, p in module.named_parameters()
            if p.requires_grad
        ]

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        # DDP rejects nn.SyncBatchNorm on CPU because torch's kernels are GPU-only; paratrain's subclass
        # has a CPU path (parallel/layers.py), so only a plain nn.SyncBatchNorm is refused there.
        if self.device_type == "cpu":
            for layer in module.modules():
                if isinstance(layer, nn.SyncBatchNorm) and not isinstance(layer, SyncBatchNorm):
                    raise ValueError(
                        "torch.nn.SyncBatchNorm only runs on GPU; on CPU convert with "
                        "paratrain.parallel.layers.convert_sync_batchnorm (--sync-batchnorm does)."
                    )

    def _unused(self) -> list[str]:
        return [n for n, p in self.module.named_parameters() if p.requires_grad and n not in self._got_grad]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self._checked and self._forwards > 0 and torch.is_grad_enabled() and self._got_grad:
            self._checked = True
            unused = self._unused()
            for h in self._mark_hooks:
                h.remove()
            if unused and self.find_unused_parameters:
                msg = (
                    f"{len(unused)} parameter(s) got no gradient in the first step: {unused[:8]}. "
                    "DDP handles them because find_unused_parameters=True, at the cost of an autograd-graph walk "
                    "after every forward; if they are never used, remove them (or set requires_grad=False) "
                    "and drop strategy.find_unused_parameters."
                )
                warnings.warn(msg, UserWarning, stacklevel=2)
                get_logger().warning(msg)
        if torch.is_grad_enabled():
            self._forwards += 1
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as e:
            if _UNFINISHED not in str(e):
                raise
            names = self._unused() if self._got_grad else []
            raise RuntimeError(
                f"DDP: parameter(s) {names[:8] or '(unknown)'} got no gradient in the previous step, so DDP's "
                "gradient all-reduce never completed (it waits for every parameter). Either use them in "
                "forward, freeze them (requires_grad=False), remove them, or pass "
                "--set strategy.find_unused_parameters=true (costs a graph walk per step). "
                "--strategy dp handles unused parameters without a flag."
            ) from e


@register_strategy("ddp")
class NativeDDP(Strategy):
    """torch's DistributedDataParallel, or its reducer with paratrain's shared-memory hook."""

    replicated_gradients = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook_state: Any = None

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        # The model must live on its device *before* wrapping: DDP registers hooks on these parameters and
        # broadcasts them from rank 0; moving afterwards would leave DDP pointing at stale tensors.
        model = model.to(self.ctx.device)
        if not self.ctx.distributed or self.ctx.world_size == 1:
            return model, optimizer  # world size 1: nothing to synchronise
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None  # = LOCAL_RANK
        ddp = _DDP(
            model,
            device_ids=device_ids,
            process_group=self.dp_group,  # None: every rank (the default group)
            forward_sync_buffers=True,  # re-broadcast buffers (BatchNorm stats) from rank 0 each forward
            bucket_cap_mb=self.config.bucket_cap_mb,
            # with the shm hook the peers read each bucket where it lies, so the copies of every gradient into
            # its bucket and back are the only copies left: gradients alias the buckets instead
            gradient_as_bucket_view=self.config.gradient_as_bucket_view
            or self.config.comm_algorithm == "shm",
            static_graph=self.config.static_graph,
            find_unused_parameters=self.config.find_unused_parameters,
        )
        if self.config.comm_algorithm == "shm":  # every bucket through shared memory (collective)
            self.hook_state, hook, how = ddp_comm_hook(self.dp_group)  # several nodes: shm inside each
            get_logger().info("ddp --comm-algorithm shm: %s", how)
            ddp.register_comm_hook(self.hook_state, hook)
        return ddp, optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if isinstance(model, DDP):
            return model.no_sync()
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model
