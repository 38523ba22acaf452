"""A mixture-of-experts feed-forward block for :class:`~paratrain.models.llama.Llama`.

A token-choice top-k router (Shazeer et al. 2017, https://arxiv.org/abs/1701.06538; GShard, Lepikhin et al.
2020, https://arxiv.org/abs/2006.16668) sends each token to ``top_k`` of ``n_experts`` SwiGLU experts; their
outputs are summed with the router's weights, plus an optional always-on shared expert (DeepSeekMoE, Dai et
al. 2024, https://arxiv.org/abs/2401.06066). Module names (torchtitan's)::

    layers.{i}.feed_forward.router.gate        nn.Linear(dim, n_experts): the gate, computed in float32
    layers.{i}.feed_forward.experts.w1/w3      [n_experts, moe_hidden, dim]   (each expert's nn.Linear weight,
    layers.{i}.feed_forward.experts.w2         [n_experts, dim, moe_hidden]    stacked along dim 0)
    layers.{i}.feed_forward.shared_experts     SwiGLU of width n_shared_experts * moe_hidden (optional)
    layers.{i}.feed_forward.expert_bias        [n_experts] buffer: the load-balancing bias (checkpointed)

**Routing.** ``scores = softmax(gate(x))`` or ``sigmoid(gate(x))`` in float32; the experts are the top-k of
``scores + expert_bias``, their weights the *unbiased* scores of those experts, renormalised to sum to 1 when
``router_renorm`` (DeepSeek-V3, https://arxiv.org/abs/2412.19437, section 2.1.2).

**Load balancing.** The auxiliary-loss-free bias of DeepSeek-V3 (Wang et al. 2024,
https://arxiv.org/abs/2408.15664): the tokens each expert received during one optimizer step are summed over
the data-parallel ranks (one all-reduce, :func:`after_optimizer_step`) and ``expert_bias`` moves by
``bias_update_rate * sign(mean - count)``, centred; every rank holds the same counts and so the same bias.
The bias changes which experts are chosen, never the weights. Optionally the sequence-level auxiliary loss of
DeepSeek-V3 (eq. 17-20), ``aux_loss_coef * sum_i f_i * P_i`` per sequence, averaged over the sequences, is
added to the training loss (:func:`pop_aux_loss`).

**Dropless by default.** Every routed token is computed. With ``capacity_factor > 0`` an expert takes at
most ``ceil(capacity_factor * tokens * top_k / n_experts)`` assignments of one forward call on one rank (GShard
/ Switch, Fedus et al. 2021, https://arxiv.org/abs/2101.03961), first come first served in token order; a
dropped assignment contributes nothing (the token keeps its residual).

**Dispatch.** The assignments are put in expert-major order with a stable sort (within an expert the tokens
keep their order), the experts compute them as one grouped GEMM (``torch._grouped_mm`` where it runs, a loop
over experts otherwise; on the CPU both give the same bits), and the results are put back with the inverse
permutation and summed over the ``top_k`` slots of each token in slot order: a deterministic combine, with no
scatter-add. Expert parallelism replaces the middle step (``MoE.dispatcher``, set by
:mod:`paratrain.parallel.expert`): the expert-major rows are exchanged with an all-to-all, computed by the
experts the rank owns, and sent back.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.models.spec import Dispatcher, register_expert_layer
from paratrain.spec.moe import is_moe_layer

if TYPE_CHECKING:
    from paratrain.spec.llama import LlamaConfig

__all__ = [
    "GroupedExperts",
    "MoE",
    "Router",
    "after_optimizer_step",
    "is_moe_layer",
    "moe_layers",
    "pop_aux_loss",
    "route_tables",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter (the tensor itself otherwise)."""
    fn = getattr(t, "to_local", None)
    return fn() if callable(fn) else t


def _in_backward() -> bool:
    """True while autograd runs a backward pass (an activation-checkpoint recompute): counts are not
    recorded twice."""
    return bool(torch._C._current_graph_task_id() != -1)


# ---------------------------------------------------------------------------------------------- router
class Router(nn.Module):
    """Token-choice top-k: ``x [T, dim] -> (experts [T, k], weights [T, k] fp32, scores [T, E] fp32)``."""

    def __init__(self, dim: int, n_experts: int, top_k: int, score: str, renorm: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.top_k, self.score, self.renorm = top_k, score, renorm

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # float32 whatever the autocast: a bf16 gate flips near-ties between experts from run to run
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), _local(self.gate.weight).float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choose = scores + bias.float() if bias is not None else scores
        experts = choose.topk(self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, experts)
        if self.renorm:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return experts, weights, scores


# ---------------------------------------------------------------------------------------------- experts
class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts, weights stacked along dim 0; forward takes rows in expert-major order."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.use_grouped_mm = True
        """Use ``torch._grouped_mm`` where it runs (the loop is the fallback, and the reference in tests)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [N, dim]``: rows of expert 0, then expert 1, ... (``counts[e]`` rows each, of this rank's
        experts); returns ``[N, dim]`` in the same order."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.use_grouped_mm and _grouped_mm_runs(x, w1, w2):
            offs = counts.to(device=x.device, dtype=torch.int64).cumsum(0).to(torch.int32)
            gmm = torch._grouped_mm
            h = F.silu(gmm(x, w1.transpose(-2, -1), offs=offs)) * gmm(x, w3.transpose(-2, -1), offs=offs)
            return gmm(h, w2.transpose(-2, -1), offs=offs)
        outs = []
        for e, xe in enumerate(torch.split(x, counts.tolist())):
            outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


def _grouped_mm_runs(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs 16-byte aligned strides; on CUDA it takes bf16 only (sm90+)."""
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0 or x.dtype != w1.dtype:
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = x.element_size()
    return all(d * size % 16 == 0 for d in (x.shape[1], w1.shape[1], w2.shape[1]))


class _SwiGLU(nn.Module):
    """The shared expert: ``w2(silu(w1(x)) * w3(x))`` (the dense :class:`~paratrain.models.llama.FeedForward`)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ---------------------------------------------------------------------------------------------- tables
def route_tables(
    experts: torch.Tensor, n_experts: int, capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The permutation of one forward call, from ``experts [T, k]`` (the router's choice per token and slot).

    Returns ``(order, counts, keep)``: ``order [A]`` lists the kept assignments (flat index ``t * k + slot``)
    in expert-major order, tokens in order within an expert (a stable sort); ``counts [E]`` the kept rows per
    expert; ``keep [T * k]`` which assignments are kept (all unless ``capacity`` drops the ones past the
    first ``capacity`` of an expert, in token order).
    """
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    keep = torch.ones_like(flat, dtype=torch.bool)
    if capacity is not None:
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        dropped = order[position >= capacity]
        keep[dropped] = False
        order = order[position < capacity]
        counts = counts.clamp(max=capacity)
    return order, counts, keep


# ---------------------------------------------------------------------------------------------- block
@register_expert_layer
class MoE(nn.Module):
    """``x [b, s, dim] -> [b, s, dim]``: routed experts (+ the shared expert), see the module docstring."""

    expert_bias: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hidden = cfg.moe_hidden or cfg.ffn_hidden
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef = cfg.aux_loss_coef
        self.bias_update_rate = cfg.bias_update_rate
        self.router = Router(cfg.dim, cfg.n_experts, cfg.top_k, cfg.router_score, cfg.router_renorm)
        self.experts = GroupedExperts(cfg.dim, hidden, cfg.n_experts)
        self.shared_experts = (
            _SwiGLU(cfg.dim, hidden * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        self.dispatcher: Dispatcher | None = None
        """Expert parallelism's exchange (set by the strategy); ``None``: every expert is local."""
        self.force_expert: int | None = None
        """Tests: route every token to this expert (all ``top_k`` slots), equal weights."""
        # per optimizer step, on this rank (zeroed by after_optimizer_step): routed tokens per expert, dropped
        # and total assignments, the auxiliary losses of the micro-batches
        # (plain CPU tensors, not buffers: the model may be built on the meta device; moved on first use)
        self._counts = torch.zeros(cfg.n_experts, dtype=torch.float64, device="cpu")
        self._dropped = torch.zeros(2, dtype=torch.float64, device="cpu")
        self._aux_sum = torch.zeros((), dtype=torch.float64, device="cpu")
        self._aux_pending: list[torch.Tensor] = []
        self.last_stats: dict[str, Any] = {}
        """This layer's figures of the last optimizer step, summed over the data-parallel ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        flat = x.reshape(-1, dim)
        experts, weights, scores = self.router(flat, self.expert_bias)
        if self.force_expert is not None:
            experts = torch.full_like(experts, self.force_expert)
            weights = torch.full_like(weights, 1.0 / self.top_k)
        tokens, k = experts.shape
        capacity = None
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * tokens * k / self.n_experts)
        order, counts, keep = route_tables(experts, self.n_experts, capacity)
        record = self.training and not _in_backward()
        if record:
            with torch.no_grad():
                routed = torch.bincount(experts.reshape(-1), minlength=self.n_experts)
                self._counts = self._counts.to(routed.device) + routed
                self._dropped = self._dropped.to(routed.device) + torch.tensor(
                    [float(tokens * k - order.numel()), float(tokens * k)], device=routed.device
                )
        rows = flat[order // k]  # expert-major
        if self.dispatcher is None:
            out_rows = self.experts(rows, counts)
        else:
            out_rows = self.dispatcher(self.experts, rows, counts)
        # back to (token, slot) order; dropped slots stay zero. Index writes of distinct rows: deterministic.
        slots = out_rows.new_zeros(tokens * k, dim)
        slots[order] = out_rows
        w = (weights * keep.view(tokens, k)).to(slots.dtype)
        out = (slots.view(tokens, k, dim) * w.unsqueeze(-1)).sum(1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if self.training and self.aux_loss_coef > 0 and not _in_backward():
            aux = self.aux_loss_coef * sequence_aux_loss(scores.view(b, s, -1), experts.view(b, s, k))
            self._aux_pending.append(aux)
            self._aux_sum = self._aux_sum.to(aux.device) + aux.detach().double()
        return out.view(b, s, dim)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """Draw the gate, then each expert stack (w1, w2, w3), then the shared expert, from the global RNG."""
        nn.init.normal_(self.router.gate.weight, std=std)
        for w, s in ((self.experts.w1, std), (self.experts.w2, out_std), (self.experts.w3, std)):
            nn.init.normal_(w, std=s)
        if self.shared_experts is not None:
            for lin, s in ((self.shared_experts.w1, std), (self.shared_experts.w2, out_std),
                           (self.shared_experts.w3, std)):  # fmt: skip
                nn.init.normal_(lin.weight, std=s)
        self.expert_bias.zero_()


def sequence_aux_loss(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without its coefficient), averaged over the sequences.

    ``scores [b, s, E]``, ``experts [b, s, k]``: per sequence, ``f_i = E / (k s) * #tokens choosing i`` and
    ``P_i`` the mean over the tokens of the scores normalised to sum 1; the loss is ``sum_i f_i P_i``
    (1 when balanced). A sequence-level mean is the same on one rank and averaged over data-parallel ranks.
    """
    b, s, n = scores.shape
    k = experts.shape[-1]
    chosen = torch.zeros(b, n, device=scores.device, dtype=torch.float32)
    chosen.scatter_add_(1, experts.reshape(b, -1), torch.ones(b, s * k, device=scores.device))
    f = chosen * (n / (k * s))
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return (f * p).sum(-1).mean()


# ---------------------------------------------------------------------------------------------- the step
def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE blocks of ``model`` (inside any wrapper), in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def pop_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The auxiliary losses of the forward passes since the last call, summed (to add to the training loss);
    ``None`` when there are none (no MoE layer, or ``aux_loss_coef = 0``)."""
    total = None
    for m in moe_layers(model):
        for aux in m._aux_pending:
            total = aux if total is None else total + aux
        m._aux_pending.clear()
    return total


@torch.no_grad()
def after_optimizer_step(
    model: nn.Module, group: Any = None, micro_batches: int = 1
) -> dict[str, Any] | None:
    """End of an optimizer step: sum every layer's counts over the data-parallel ``group`` (one all-reduce),
    move each expert bias toward balance, and return the step's figures (``None`` without MoE layers).

    Collective over ``group`` (every data-parallel rank calls it, after ``optimizer.step()``). The counts are
    the same on every rank afterwards, so the biases stay identical. Returns ``tokens_per_expert`` (a list per
    layer), ``overload`` (the largest over layers of max / mean tokens per expert), ``dropped_fraction`` and
    ``aux_loss`` (the step's auxiliary loss, mean over micro-batches and ranks).
    """
    layers = moe_layers(model)
    if not layers:
        return None
    device = layers[0].expert_bias.device
    dropped = torch.stack([m._dropped.to(device) for m in layers]).sum(0)
    aux_sum = torch.stack([m._aux_sum.to(device) for m in layers]).sum().view(1)
    packed = torch.cat([m._counts.to(device) for m in layers] + [dropped, aux_sum])
    ranks = 1
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, group=group)
        ranks = dist.get_world_size(group)
    tables, offset = [], 0
    for m in layers:
        counts = packed[offset : offset + m.n_experts]
        offset += m.n_experts
        tables.append(counts)
        if m.bias_update_rate > 0 and m.training:
            delta = m.bias_update_rate * torch.sign(counts.mean() - counts)
            m.expert_bias.add_((delta - delta.mean()).to(m.expert_bias.dtype))
        m.last_stats = {"tokens_per_expert": [int(c) for c in counts.tolist()]}
        # a loss function that never collected them (a pipeline stage without the loss) must not let them pile up
        m._aux_pending.clear()
        m._counts.zero_()
        m._dropped.zero_()
        m._aux_sum.zero_()
    dropped, assigned, aux = packed[offset], packed[offset + 1], packed[offset + 2]
    overload = max(float(c.max() / c.mean()) if c.sum() > 0 else 0.0 for c in tables)
    return {
        "tokens_per_expert": [m.last_stats["tokens_per_expert"] for m in layers],
        "overload": overload,
        "dropped_fraction": float(dropped / assigned) if assigned > 0 else 0.0,
        "aux_loss": float(aux) / (ranks * micro_batches),
    }


def _layer_index(name: str) -> tuple[int, str]:
    """Sort key of an MoE block's module name: the number after ``layers`` (a pipeline stage keeps the global
    keys of its blocks), then the name."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1]), name
    return -1, name


def merge_stage_stats(parts: list[tuple[list[str], dict[str, Any] | None]]) -> dict[str, Any] | None:
    """One run's expert-load figures from those of its pipeline stages.

    ``parts`` holds, per stage rank, the module names of its MoE blocks and what :func:`after_optimizer_step`
    returned there (``None`` for a stage without MoE blocks). ``tokens_per_expert`` lists every block of the
    model in layer order; ``overload`` is the largest; ``dropped_fraction`` is weighted by the tokens each stage
    routed; ``aux_loss`` adds up (each stage's blocks contribute their own terms)."""
    rows: dict[str, list[int]] = {}
    overload, dropped, routed, aux, any_stats = 0.0, 0.0, 0.0, 0.0, False
    for names, stats in parts:
        if not stats:
            continue
        any_stats = True
        tables = stats["tokens_per_expert"]
        rows.update(zip(names, tables, strict=True))
        stage_routed = float(sum(sum(t) for t in tables))
        overload = max(overload, float(stats["overload"]))
        dropped += float(stats["dropped_fraction"]) * stage_routed
        routed += stage_routed
        aux += float(stats["aux_loss"])
    if not any_stats:
        return None
    return {
        "tokens_per_expert": [rows[n] for n in sorted(rows, key=_layer_index)],
        "overload": overload,
        "dropped_fraction": dropped / routed if routed > 0 else 0.0,
        "aux_loss": aux,
    }
