"""``python -m paratrain.lint [--json] [--select R] [--ignore R] PATH...``: ``paratrain lint``."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m paratrain.lint"))
