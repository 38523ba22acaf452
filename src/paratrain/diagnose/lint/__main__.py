"""``python -m paratrain.diagnose.lint [--json] [--select R] [--ignore R] PATH...``: ``paratrain lint``."""

from __future__ import annotations

import argparse
import os
import sys

from .cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paratrain.diagnose.lint",
        description="Static checks for distributed PyTorch training scripts (see docs/lint.md).",
    )
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except BrokenPipeError:  # `... | head`: the reader left; exit quietly as other CLI tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
