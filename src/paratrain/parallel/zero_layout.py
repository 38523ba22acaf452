"""The bookkeeping of ``zero1``/``zero2``'s sharded optimizer: where each parameter's rows live in the
rank-major bucket layout, and how the owned rows' optimizer state is shown to Distributed Checkpoint.

The communication itself (which collective, when, what waits for what) is in :mod:`paratrain.parallel.zero`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(eq=False)
class _Slot:
    """One parameter inside a bucket: its rows, its place in the rank-major flat layout, its shard."""

    param: nn.Parameter
    chunk_rows: int  # ceil(d0 / N): rows of every rank's chunk in the (padded) flat layout
    row_numel: int  # elements per row (prod of dims 1..)
    lo: int  # first row this rank owns
    hi: int  # one past the last row this rank owns (lo == hi: owns nothing)
    offset: int  # start of this parameter's chunk inside one rank's segment
    shard: nn.Parameter  # view of param rows [lo:hi]: what the inner optimizer updates

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @property
    def owned_numel(self) -> int:
        return (self.hi - self.lo) * self.row_numel


@dataclass(eq=False)
class _Bucket:
    slots: list[_Slot]
    segment: int  # elements of one rank's segment (sum of padded chunk sizes)
    ready: int = 0  # gradients ready in this backward (zero2 hooks)
    work: Any = None  # in-flight reduce-scatter
    send: torch.Tensor | None = None  # reduce-scatter input, kept alive until the work finishes
    grad: torch.Tensor | None = None  # reduced gradient of this rank's segment (after wait: mean)
    reduced: bool = False
    in_place: bool = False  # all-reduced in ``send`` (Gloo): this rank's rows are copied out of it


class ShardLayout:
    """Mixin of :class:`~paratrain.parallel.zero.ShardedOptimizer`: bucket layout, packing, DCP state view.

    Every parameter is split along dim 0 into ``world`` chunks of ``ceil(d0 / world)`` rows; rank r owns
    chunk r. A bucket's flat buffer holds ``world`` segments, one per rank, so one reduce-scatter or
    all-gather moves a whole bucket.
    """

    world: int
    rank: int
    mesh: Any
    optim: torch.optim.Optimizer
    param_groups: list[dict[str, Any]]
    state: Any
    _slots: dict[nn.Parameter, _Slot]
    _bucket_of: dict[nn.Parameter, _Bucket]

    # ---- layout ----------------------------------------------------------------------------------------
    def _make_buckets(self, params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        slots: list[_Slot] = []
        offset = 0
        for p in params:
            d0 = p.shape[0]
            chunk_rows = math.ceil(d0 / self.world)
            row_numel = p[0].numel() if d0 else 0
            lo = min(self.rank * chunk_rows, d0)
            hi = min(lo + chunk_rows, d0)
            shard = nn.Parameter(p.detach()[lo:hi], requires_grad=p.requires_grad)  # shares p's storage
            slot = _Slot(p, chunk_rows, row_numel, lo, hi, offset, shard)
            self._slots[p] = slot
            slots.append(slot)
            offset += slot.chunk_numel
            if offset * self.world * p.element_size() >= cap_bytes:
                buckets.append(_Bucket(slots, offset))
                slots, offset = [], 0
        if slots:
            buckets.append(_Bucket(slots, offset))
        for b in buckets:
            for s in b.slots:
                self._bucket_of[s.param] = b
        return buckets

    def _rank_major(self, flat: torch.Tensor, b: _Bucket, s: _Slot) -> torch.Tensor:
        """View of ``flat`` (N * segment elements) as (N, chunk) for slot ``s``: row j = rank j's chunk."""
        return flat.view(self.world, b.segment)[:, s.offset : s.offset + s.chunk_numel]

    @staticmethod
    def _full_chunks(s: _Slot) -> tuple[int, int]:
        """(ranks whose chunk is full, elements of the one partial chunk after them)."""
        total = s.param.shape[0] * s.row_numel
        full = total // s.chunk_numel if s.chunk_numel else 0
        return full, total - full * (s.chunk_numel if s.chunk_numel else 0)

    def _pack(self, dst: torch.Tensor, src: torch.Tensor, s: _Slot) -> None:
        """Copy a full tensor (flat) into its (N, chunk) rank-major view ``dst``; padding is left alone."""
        k, rem = self._full_chunks(s)
        if k:
            dst[:k].copy_(src[: k * s.chunk_numel].view(k, s.chunk_numel))
        if rem:
            dst[k, :rem].copy_(src[k * s.chunk_numel :])

    def _unpack(self, src: torch.Tensor, dst: torch.Tensor, s: _Slot) -> None:
        """Inverse of :meth:`_pack`: the (N, chunk) view ``src`` back into the full tensor (flat)."""
        k, rem = self._full_chunks(s)
        if k:
            dst[: k * s.chunk_numel].view(k, s.chunk_numel).copy_(src[:k])
        if rem:
            dst[k * s.chunk_numel :].copy_(src[k, :rem])

    # ---- state for Distributed Checkpoint ------------------------------------------------------------
    def _as_global(self, value: Any, s: _Slot) -> Any:
        """Per-row state of the owned rows -> DTensor ``Shard(0)`` with the parameter's full shape."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != s.shard.shape:
            return value
        if self.mesh is None:
            return value  # one rank: the owned rows are all rows
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(
            value, self.mesh, [Shard(0)], run_check=False, shape=s.param.shape, stride=s.param.stride()
        )

    def _refresh_state_view(self) -> None:
        # ``self.state`` mirrors the inner state keyed by the full parameters (DCP checks it is non-empty).
        self.state.clear()
        for p, s in self._slots.items():
            st = self.optim.state.get(s.shard)
            if st:
                self.state[p] = {k: self._as_global(v, s) for k, v in st.items()}

    def _ordered(self) -> list[nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        self._refresh_state_view()
        order = self._ordered()
        index: dict[torch.Tensor, int] = {p: i for i, p in enumerate(order)}
        state = {index[p]: dict(st) for p, st in self.state.items()}
        groups = []
        for g in self.param_groups:
            groups.append(
                {**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
            )
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}"
            )
        # Saved keys (indices, or FQNs when DCP hands the dict over) map to parameters by position in the
        # groups, as torch.optim.Optimizer.load_state_dict does.
        key_to_param: dict[Any, nn.Parameter] = {}
        for g, sg in zip(self.param_groups, saved_groups, strict=True):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError("optimizer state: a param group has a different number of parameters")
            key_to_param.update(zip(sg["params"], g["params"], strict=True))
            g.update({k: v for k, v in sg.items() if k != "params"})
        for key, st in state_dict["state"].items():
            p = key_to_param[key]
            s = self._slots[p]
            local: dict[str, Any] = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    to_local = getattr(v, "to_local", None)
                    if callable(to_local):
                        v = to_local()
                    elif v.dim() > 0 and v.shape == p.shape:
                        v = v[s.lo : s.hi]  # a full (unsharded) tensor: keep the owned rows
                    dev = s.shard.device if v.dim() > 0 else v.device
                    v = v.detach().to(dev).clone()
                local[k] = v
            self.optim.state[s.shard] = local
        for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self._refresh_state_view()
