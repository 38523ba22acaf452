"""Reading a verified checkpoint back: the training state, this rank's RNG tensors, then the model and
optimizer state through DCP. Nothing is unpickled (:mod:`paratrain.checkpoint.safe`); a damaged file is one
:class:`DamagedCheckpointError` naming it.

Reference: https://pytorch.org/docs/stable/distributed.checkpoint.html
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.checkpoint import safe
from paratrain.checkpoint.collective import all_names
from paratrain.checkpoint.errors import CheckpointError, DamagedCheckpointError
from paratrain.checkpoint.layout import compare_state, mismatch_message, model_shapes, step_of
from paratrain.checkpoint.state import load_rank_state, read_train_state
from paratrain.runtime import Context

StateFns = tuple[Callable[..., Any], Callable[..., Any]]
"""``(get(model, optim) -> (model_sd, optim_sd), set(model, optim, model_sd, optim_sd))``."""


@dataclass
class Loaded:
    path: Path
    train_state: dict[str, Any]
    rank_state: dict[str, torch.Tensor] | None
    """This rank's RNG/generator tensors; ``None`` when the checkpoint had no file for this rank."""


def default_state_fns(flatten: bool = True) -> StateFns:
    """DCP's state-dict functions. ``flatten``: optimizer state keyed ``state.<fqn>.<key>`` and
    ``param_groups.<fqn>.<key>`` (format 2). Each rank then saves exactly its own parameters' entries, which a
    pipeline stage needs (the nested form keeps one rank's ``param_groups.N.params`` list, so stages holding
    different parameters could not load it). Format-1 checkpoints were saved nested."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    def _get(model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return get_state_dict(model, optimizer, options=options)

    def _set(model: nn.Module, optimizer: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        set_state_dict(
            model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
        )

    return _get, _set


def read_states(p: Path, ctx: Context) -> tuple[list[str], dict[str, Any], dict[str, torch.Tensor] | None]:
    """This rank's problems reading the training state and its RNG tensors (the latter only when the
    checkpoint was saved at this world size), and what it read."""
    try:
        state = read_train_state(p, step_of(p))
        same_world = state["world_size"] == ctx.world_size
        rank_state = load_rank_state(p, ctx.rank) if same_world else None
    except safe.DamagedFileError as e:
        return [str(e)], {}, None
    return [], state, rank_state


def load_state_dicts(p: Path, model: nn.Module, optimizer: Any, fns: StateFns, ctx: Context) -> None:
    """Check ``p``'s tensors against ``model`` (names, shapes), read them with DCP into this rank's state
    dicts, and apply those. Collective; DCP raises the same error on every rank."""
    get, put = fns
    md = safe.read_metadata(p)
    model_sd, optim_sd = get(model, optimizer)
    shapes = model_shapes(model_sd)
    mismatches = compare_state(md, shapes, known=all_names(shapes, ctx))
    if mismatches:
        raise CheckpointError(mismatch_message(p, mismatches))
    to_load = {"model": model_sd, "optim": optim_sd}
    try:
        with single_process_quiet():
            dcp.load(
                to_load,
                storage_reader=safe.SafeFileSystemReader(str(p)),
                planner=safe.SafeLoadPlanner(),
                no_dist=not ctx.distributed,
            )
    except (Exception, CheckpointException) as e:  # DCP raises the same CheckpointException on all ranks
        damaged = safe.first_cause(e, safe.DamagedFileError)
        what = f"file {damaged.file}): {damaged.reason}" if damaged else f"while reading): {_one_line(e)}"
        raise DamagedCheckpointError(f"checkpoint {p} is damaged ({what}", model_touched=True) from None
    try:
        put(model, optimizer, to_load["model"], to_load["optim"])
    except Exception as e:
        raise DamagedCheckpointError(
            f"checkpoint {p} is damaged (model/optimizer state): it cannot be applied: {_one_line(e)}",
            model_touched=True,
        ) from None


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns "assuming the intent is to save in a single process" at world size 1: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def _one_line(e: BaseException) -> str:
    root = next((c for c in safe.causes(e) if not isinstance(c, CheckpointException)), e)
    if isinstance(root, CheckpointException):
        return "DCP reported a failure"
    return safe.describe_read_error(root)
