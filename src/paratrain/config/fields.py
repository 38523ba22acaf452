"""How a config field is declared (:func:`option`, :func:`choice`) and checked (``check_*``), and the
choices more than one section shares."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import field
from typing import Any

from paratrain.errors import ConfigError, suggest

COMM_ALGORITHMS: tuple[str, ...] = ("native", "ring", "tree", "naive", "rhd", "shm", "pairwise")
"""Every collective algorithm name, in one place: ``comm``, ``--comm-algorithm`` and ``bench comm`` use it."""

TRACKERS: tuple[str, ...] = ("csv", "tensorboard", "mlflow", "wandb")
"""Experiment trackers of ``--tracker`` (``paratrain.train.trackers``)."""

AC_MODES: tuple[str, ...] = ("none", "full", "selective")
"""``--activation-checkpointing`` modes; ``selective:N`` (every N-th block fully recomputed) is also valid."""


def ac_policy(value: str | bool | None) -> tuple[str, int]:
    """``(mode, every)`` of an ``activation_checkpointing`` value: ``none``/``full``/``selective`` (op-level) or
    ``selective:N`` -> ``("full", N)`` for every N-th block; ``true``/``false`` are ``full``/``none``."""
    if value is None or value is False or value == "false":
        return "none", 1
    if value is True or value == "true":
        return "full", 1
    head, _, n = str(value).partition(":")
    if head in AC_MODES and not n:
        return head, 1
    if head == "selective" and n.isdigit() and int(n) >= 1:
        return ("full", 1) if int(n) == 1 else ("every", int(n))
    raise ConfigError(f"train.activation_checkpointing={value!r} is not valid: choose none, full, selective (save "
                      "the outputs of matmuls and attention, recompute the rest) or selective:N (every N-th "
                      "block fully recomputed, N >= 1).")  # fmt: skip


TRAIN, LAUNCH = "train", "launch"
"""Commands whose flags an option appears under (``option(scope=...)``)."""
BOTH = (TRAIN, LAUNCH)
"""Options that are flags of both ``train`` and ``launch``."""


def option(
    default: Any = dataclasses.MISSING,
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    choices: Sequence[str] | None = None,
    scope: tuple[str, ...] = (TRAIN,),
    metavar: str | None = None,
    default_factory: Any = dataclasses.MISSING,
    const: tuple[str, str] | None = None,
) -> Any:
    """A config field that is also a command-line flag (``--field-name`` unless ``flag`` is given). ``const``
    ``(on, off)``: the flag alone means ``on`` and ``--no-field-name`` means ``off`` (a boolean grown choices)."""
    md = {
        "const": const,
        "cli": True,
        "flag": flag,
        "aliases": aliases,
        "choices": choices,
        "scope": scope,
        "metavar": metavar,
    }
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=md)
    return field(default=default, metadata=md)


def check_positive(section: str, name: str, value: float | int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is not None and not math.isfinite(value):  # NaN passed `<= 0`; inf is no setting either
        raise ConfigError(f"{section}.{name} must be a finite number, got {value!r}. Set a value > 0.")
    if value is None or value <= 0:
        raise ConfigError(f"{section}.{name} must be positive, got {value!r}. Set a value > 0.")


def choice(default: str, choices: Sequence[str]) -> Any:
    """A config field (not a flag) whose value is one of ``choices``, checked by :func:`check_choices`."""
    return field(default=default, metadata={"choices": tuple(choices)})


def check_choice(section: str, name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name}={value!r} is not valid. {suggest(value, choices)}")


def check_choices(obj: Any, section: str) -> None:
    """Every field of ``obj`` declared with ``choices`` (:func:`option` or :func:`choice`) holds one of them:
    the choices are stated once, where the field is declared."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        if choices is not None:
            check_choice(section, f.name, getattr(obj, f.name), choices)


def check_range(section: str, name: str, value: float, lo: float, hi: float, hi_open: bool = False) -> None:
    ok = lo <= value < hi if hi_open else lo <= value <= hi
    if not ok:
        bracket = ")" if hi_open else "]"
        raise ConfigError(f"{section}.{name} must be in [{lo}, {hi}{bracket}, got {value!r}.")
