"""One converter for TOML values, JSON values and command-line strings: :func:`convert`."""

from __future__ import annotations

import math
import types
import typing
from typing import Any, get_args, get_origin

from paratrain.errors import ConfigError

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def convert(value: Any, tp: Any, where: str) -> Any:
    """``value`` as the declared type ``tp``: strings (flags, ``--set``) are parsed, TOML/JSON values are
    checked; ints widen to floats; floats must be finite. Raises :class:`ConfigError` naming ``where``."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if type(None) in get_args(tp) and (
            value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        ):
            return None
        errors = []
        for arg in args:
            try:
                return convert(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is tuple:
        args = get_args(tp)  # type: ignore[assignment]
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]  # type: ignore[assignment]
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} comma-separated values, got {value!r}")
        return tuple(
            convert(v.strip() if isinstance(v, str) else v, a, where)
            for v, a in zip(value, args, strict=True)
        )
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number: float | None = None
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        elif isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{where}: must be a finite number, got {value!r}.")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value
