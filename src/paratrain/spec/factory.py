"""A user's own model or dataset named by an import path, as Lightning CLI's class paths are:
``--model mypkg.models:build``, ``--data mypkg.data:build``.

``module:attr`` names a callable in an importable module. The current directory is importable (as under
``python -m``), so a package next to where ``paratrain`` runs needs no installation. The callable is
called with the keyword arguments it accepts among those offered (:func:`call_accepting`); the model and
data registries say which they offer. Torch-free: a bad path is refused before torch is imported.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

from paratrain.errors import ConfigError

_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_import_path(name: str) -> bool:
    """Whether ``name`` is written ``module:attr`` (``pkg.module:factory``, ``mod:Class.create``)."""
    return bool(_PATH.fullmatch(name))


def load_object(path: str, what: str) -> Callable[..., Any]:
    """The callable ``path`` (``module:attr``) names; :class:`ConfigError` naming what is wrong otherwise.

    ``what`` is the flag in messages (``--model``, ``--data``)."""
    module_name, _, attr = path.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # a package in the current directory, as under ``python -m``
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ConfigError(
                f"{what} {path}: no module named {e.name!r} (looked in the current directory {cwd} and on "
                "sys.path). Run paratrain from the directory that holds the package, or install it."
            ) from None
        raise ConfigError(f"{what} {path}: importing {module_name} failed: {e}") from None
    except Exception as e:  # the user's module raised while importing: name it, with its error
        raise ConfigError(f"{what} {path}: importing {module_name} raised {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {path}: {module_name} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what} {path}: {attr} is a {type(obj).__name__}, not a function or class.")
    return obj  # type: ignore[no-any-return]


def call_accepting(fn: Callable[..., Any], what: str | None = None, /, **offered: Any) -> Any:
    """``fn(**kw)`` with the keyword arguments of ``offered`` that ``fn`` accepts (all of them when it takes
    ``**kwargs``). A parameter without a default that is not offered is refused with :class:`ConfigError`
    naming it and what is offered (``what``: the flag and path in the message), before ``fn`` runs."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: call it bare
        return fn()
    missing = [
        n for n, p in params.items()
        if p.default is p.empty and p.kind is not p.VAR_POSITIONAL and p.kind is not p.VAR_KEYWORD
        and (n not in offered or p.kind is p.POSITIONAL_ONLY)
    ]  # fmt: skip
    if missing:
        name = what or getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(
            f"{name} needs {', '.join(repr(n) for n in missing)}, which paratrain does not pass: it calls it with "
            f"the keyword arguments it accepts among {', '.join(offered)}. Give the other parameters defaults "
            "(or read them from the environment)."
        )
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        names = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        offered = {k: v for k, v in offered.items() if k in names}
    try:
        return fn(**offered)
    except ConfigError:
        raise
    except Exception as e:
        if what is None:
            raise
        # one line naming the factory, the error and the user's line that raised it (or called the library
        # that did), rather than a traceback through paratrain's preflight
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
        own = [f for f in frames if not _LIBRARY.search(f.filename)] or frames
        at = f" (at {own[-1].filename}:{own[-1].lineno})" if own else ""
        raise ConfigError(f"{what} raised {type(e).__name__}: {e}{at}") from e


_LIBRARY = re.compile(r"/(site-packages|dist-packages|lib/python\d+\.\d+)/")
