"""What each worker runs under ``paratrain launch --guard``: install the guard, then the user's script.

    python -m paratrain.diagnose.guard.bootstrap [--hang-timeout S] [--check-desync-every K]
        [--guard-dir DIR] [--store] -- train.py ARGS...        (or: -- -m package.module ARGS...)

The script runs as ``python train.py ARGS...`` would run it: ``runpy.run_path(script, run_name="__main__")``
with ``sys.argv = [script, *ARGS]`` and the script's directory first on ``sys.path``. Settings not given
on the command line come from ``PARATRAIN_GUARD_HANG_TIMEOUT``, ``PARATRAIN_GUARD_DESYNC_EVERY`` and
``PARATRAIN_GUARD_DIR``. Without a guard directory (e.g. under plain ``torchrun``), or in a multi-node job,
the records travel through the c10d store and global rank 0 analyzes them (:mod:`watch`).

A fatal guard finding raised in the worker (a desync) is printed once per job and the worker exits with
status 1, which makes the elastic agent stop the others.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

DEFAULT_HANG_TIMEOUT = 300.0
DEFAULT_DESYNC_EVERY = 100

_SCRIPT_GLOBALS: list[dict[str, object]] = []
"""The finished script's globals, kept to interpreter finalization as ``python train.py`` keeps them: released
when ``runpy`` returns, the script's DDP model and process group were destroyed on the main thread while a Gloo
worker thread still needed the GIL to drop its last collective, and the rank hung there (1 run in about 10 of
a DDP script under ``launch --guard``); at finalization the exit grace runs first (``install_exit_grace``)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paratrain.diagnose.guard.bootstrap", allow_abbrev=False)
    p.add_argument("--hang-timeout", type=float, default=None, metavar="S")
    p.add_argument("--check-desync-every", type=int, default=None, metavar="K")
    p.add_argument("--guard-dir", default=None, metavar="DIR")
    p.add_argument("--store", action="store_true", help="publish records in the c10d store even on one node")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, str, bool, list[str]]:
    """``(options, target, is_module, script_args)``."""
    if "--" in argv:
        cut = argv.index("--")
        head, tail = argv[:cut], argv[cut + 1 :]
    else:
        head, tail = [], list(argv)
        while tail and tail[0].startswith("--") and tail[0] != "-m":
            takes_value = tail[0] not in ("--store",) and "=" not in tail[0]
            head += tail[: 2 if takes_value else 1]
            tail = tail[2 if takes_value else 1 :]
    opts = _parser().parse_args(head)
    if not tail:
        _parser().error("give the script to run: ... -- train.py [ARGS]")
    is_module = tail[0] == "-m"
    if is_module:
        tail = tail[1:]
        if not tail:
            _parser().error("-m needs a module name")
    env = os.environ
    if opts.hang_timeout is None:
        opts.hang_timeout = float(env.get("PARATRAIN_GUARD_HANG_TIMEOUT", DEFAULT_HANG_TIMEOUT))
    if opts.check_desync_every is None:
        opts.check_desync_every = int(env.get("PARATRAIN_GUARD_DESYNC_EVERY", DEFAULT_DESYNC_EVERY))
    if opts.guard_dir is None:
        opts.guard_dir = env.get("PARATRAIN_GUARD_DIR") or None
    return opts, tail[0], is_module, tail[1:]


def main(argv: list[str] | None = None) -> None:
    opts, target, is_module, script_args = parse(list(sys.argv[1:] if argv is None else argv))
    from paratrain.diagnose.guard import checks
    from paratrain.diagnose.guard.desync import GuardError
    from paratrain.diagnose.guard.hooks import Guard
    from paratrain.diagnose.guard.record import EXITED, FAILED
    from paratrain.runtime import install_exit_grace

    install_exit_grace()  # before the script registers its own atexit handlers, so it runs after them
    guard = Guard(opts.guard_dir, opts.hang_timeout, opts.check_desync_every, True if opts.store else None)
    guard.install()
    sys.argv = [target, *script_args]
    if not is_module:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    state = FAILED
    try:
        if is_module:
            _SCRIPT_GLOBALS.append(runpy.run_module(target, run_name="__main__", alter_sys=True))
        else:
            _SCRIPT_GLOBALS.append(runpy.run_path(target, run_name="__main__"))
        state = EXITED
    except SystemExit as e:
        state = EXITED if e.code in (None, 0) else FAILED
        raise
    except GuardError as e:
        guard.report(str(e))
        raise SystemExit(1) from None
    finally:
        guard.compare_inputs()  # a script without optimizer steps
        guard.writer.set_counts(guard.desync_checks, checks.warned)
        guard.writer.finish(state)


if __name__ == "__main__":
    main()
