"""``python -m paratrain.diagnose.guard.run [--nproc-per-node N] [guard flags] script.py ARGS...``

The guarded launcher on its own (``paratrain launch --guard`` calls the same :func:`launch_guarded`).
"""

from __future__ import annotations

import argparse
import sys

from paratrain.diagnose.guard.launcher import add_guard_arguments, launch_guarded
from paratrain.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paratrain.diagnose.guard.run", allow_abbrev=False)
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N")
    p.add_argument("-m", dest="module", action="store_true", help="run a module, as python -m does")
    add_guard_arguments(p)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    from paratrain.config import LaunchConfig

    try:
        launch = LaunchConfig(nproc_per_node=args.nproc_per_node)
        return launch_guarded(
            args.script,
            args.script_args,
            launch,
            args.hang_timeout,
            args.check_desync_every,
            args.module,
            json_summary=args.json,
        )
    except ConfigError as e:
        print(f"paratrain guard: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
