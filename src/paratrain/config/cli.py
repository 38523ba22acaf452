"""Command-line flags generated from the config fields, one mechanism for every command.

``train``, ``launch`` and ``plan`` take the fields of :class:`RunConfig`'s sections (:func:`add_arguments`,
:func:`apply_arguments`: unset flags stay ``None`` and the config's value wins). A command with a config
dataclass of its own (``generate``, ``bench comm``, ``bench scaling``) takes its fields the same way
(:func:`add_command_arguments`, :func:`command_config`): same flag names, help from the field docstrings,
choices from ``option(choices=...)``, values through :func:`convert`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, get_args, get_origin

from paratrain.config.convert import convert
from paratrain.config.run import RunConfig, section_types
from paratrain.errors import ConfigError

_C = TypeVar("_C")


@dataclass(frozen=True)
class CliOption:
    """One config field exposed as a flag."""

    section: str
    key: str
    flags: tuple[str, ...]
    type: Any
    choices: Sequence[str] | None
    help: str
    metavar: str | None
    default: Any
    const: tuple[str, str] | None = None

    @property
    def dest(self) -> str:
        """``section__key`` for a :class:`RunConfig` field; the field name for a command's own config."""
        return f"{self.section}__{self.key}" if self.section else self.key


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (parsed from its source with ``ast``)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen app): help without text
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.replace("``", "").split())
    return docs


def _field_options(section: str, cls: type, scope: str | None) -> list[CliOption]:
    """The fields of dataclass ``cls`` declared with :func:`option` (for command ``scope``; ``None``: all)."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        md = f.metadata
        if not md.get("cli") or (scope is not None and scope not in md["scope"]):
            continue
        flag = md["flag"] or "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(CliOption(section, f.name, (flag, *md["aliases"]), hints[f.name], md["choices"],
                             docs.get(f.name, ""), md["metavar"], default, md.get("const")))  # fmt: skip
    return out


def cli_options(scope: str, sections: Sequence[str] | None = None) -> list[CliOption]:
    """Every field of :class:`RunConfig` declared with :func:`option` for command ``scope``."""
    out = []
    for sec, cls in section_types().items():
        if sections is None or sec in sections:
            out += _field_options(sec, cls, scope)
    return out


def command_options(cls: type) -> list[CliOption]:
    """Every field of a command's own config dataclass ``cls`` declared with :func:`option`."""
    return _field_options("", cls, None)


def _base_type(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in get_args(tp) if a is not type(None))
    return tp


def add_arguments(parser: argparse.ArgumentParser, scope: str, sections: Sequence[str] | None = None) -> None:
    """Add one flag per config option of ``scope``; unset flags stay ``None`` (the config's value wins)."""
    for o in cli_options(scope, sections):
        _add_flag(parser, o, None)


def add_command_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per option field of the command config ``cls``, defaulting to the field's default (the
    namespace holds every value; :func:`command_config` builds and so validates ``cls`` from it)."""
    for o in command_options(cls):
        _add_flag(parser, o, o.default)


def command_config(cls: type[_C], args: argparse.Namespace) -> _C:
    """``cls`` from the parsed flags of :func:`add_command_arguments` (its ``__post_init__`` checks them)."""
    return cls(**{o.key: getattr(args, o.dest) for o in command_options(cls)})


def _add_flag(parser: argparse.ArgumentParser, o: CliOption, default: Any) -> None:
    """One flag for option ``o``: a bool is ``--x/--no-x``, a ``const`` option takes an optional value, any
    other is read by :func:`convert` into the field's type (choices checked by argparse)."""
    base = _base_type(o.type)
    shown = o.default is not None and o.default is not False and o.default != ""
    text = o.help + (f" (default: {o.default})" if shown else "")
    kwargs: dict[str, Any] = {"dest": o.dest, "default": default, "help": text.replace("%", "%%")}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif o.const:
        kwargs.update(nargs="?", const=o.const[0], metavar=o.metavar or o.key.upper())
        parser.add_argument(*o.flags, **kwargs)
        negative = "--no-" + o.flags[0].removeprefix("--")
        parser.add_argument(
            negative, dest=o.dest, action="store_const", const=o.const[1], help=argparse.SUPPRESS
        )
        return
    else:
        where = o.flags[0]
        kwargs["type"] = lambda raw, _tp=o.type, _w=where: _parse_flag(raw, _tp, _w)
        kwargs["choices"] = list(o.choices) if o.choices else None
        kwargs["metavar"] = o.metavar or ("{" + ",".join(o.choices) + "}" if o.choices else o.key.upper())
    parser.add_argument(*o.flags, **kwargs)


def _parse_flag(raw: str, tp: Any, where: str) -> Any:
    try:
        return convert(raw, tp, where)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None


def apply_arguments(cfg: RunConfig, args: argparse.Namespace, scope: str) -> RunConfig:
    """Write the flags the user gave (not ``None``) into ``cfg``; each section is re-validated."""
    data = cfg.to_dict()
    for o in cli_options(scope):
        value = getattr(args, o.dest, None)
        if value is not None:
            data[o.section][o.key] = value
    return RunConfig.from_dict(data, source="command line")


def add_set_argument(
    parser: argparse.ArgumentParser, example: str = "--set optimizer.weight_decay=0.01"
) -> None:
    """``--set SECTION.KEY=VALUE ...``: any config field, several per flag, the flag repeatable (train, plan and
    bench scaling take it alike)."""
    parser.add_argument("--set", action="append", nargs="+", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"set any config field, e.g. {example} (several per flag; repeatable)")  # fmt: skip


def set_values(args: argparse.Namespace) -> list[str]:
    """The ``SECTION.KEY=VALUE`` items of every ``--set`` flag, in order."""
    return [
        x
        for group in (getattr(args, "set", None) or [])
        for x in (group if isinstance(group, list) else [group])
    ]


def iter_options(scope: str) -> Iterator[str]:
    """Flag names of ``scope`` (for docs and tests)."""
    for o in cli_options(scope):
        yield from o.flags
