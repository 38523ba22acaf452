"""``paratrain ckpt inspect DIR [--fast] [--json]`` and ``paratrain ckpt export STEP_DIR OUT.safetensors [--force]``.

Bad input (a missing path, a plain file given as a directory, an existing output) raises ``ConfigError``:
the CLI prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

WHAT = "a run directory, its checkpoints/ directory, its latest file or one step_NNNNNNNN directory"


def add_ckpt_commands(sub: Any) -> None:
    p = sub.add_parser("ckpt", help="inspect and export checkpoints")
    ck = p.add_subparsers(dest="ckpt_command", required=True)
    q = ck.add_parser(
        "inspect", help="steps, sizes, world size, strategy and validity of a checkpoint directory"
    )
    q.add_argument(
        "dir",
        help="a run directory, its checkpoints/ directory (with step_NNNNNNNN/ inside), latest or one step",
    )
    q.add_argument(
        "--fast", action="store_true", help="check sizes only; do not read every file to compare its checksum"
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_inspect)
    q = ck.add_parser(
        "export",
        help="write the consolidated full model of a checkpoint as safetensors or a Hugging Face directory",
    )
    q.add_argument(
        "step_dir",
        help="a run directory, its checkpoints/ or latest (the newest valid step), or one step_NNNNNNNN",
    )
    q.add_argument("out", help="output .safetensors file (--format safetensors) or directory (--format hf)")
    q.add_argument(
        "--format", choices=("safetensors", "hf"), default="safetensors",
        help="safetensors: one file of paratrain's tensors; hf: a directory from_pretrained() loads (hf:DIR runs, "
        "llama-* as LlamaForCausalLM)",
    )  # fmt: skip
    q.add_argument("--max-shard-size", default="2GB", help="--format hf: largest weight file (default 2GB)")
    q.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_export)


def cmd_inspect(args: argparse.Namespace) -> int:
    _require(args.dir)
    from paratrain.checkpoint.inspect import format_inspect, inspect_dir

    info = inspect_dir(args.dir, fast=args.fast)
    print(json.dumps(info) if args.json else format_inspect(info))
    return 0


def _require(path: str) -> None:
    """A path that does not exist is refused before torch is imported (under a second, not several)."""
    if not Path(path).exists():
        raise ConfigError(f"{path} does not exist. Give {WHAT}.")


def cmd_export(args: argparse.Namespace) -> int:
    _require(args.step_dir)
    from paratrain.checkpoint.inspect import export_safetensors

    if args.format == "hf":
        from paratrain.checkpoint.export_hf import export_hf

        out = export_hf(args.step_dir, args.out, force=args.force, max_shard=args.max_shard_size)
        print(
            json.dumps(out)
            if args.json
            else f"wrote {out['tensors']} tensors ({out['bytes'] / 2**20:.2f} MiB) in {out['files']} file(s) "
            f"to {out['out']}"
        )
        return 0

    info = export_safetensors(args.step_dir, args.out, force=args.force)
    print(
        json.dumps(info)
        if args.json
        else f"wrote {info['tensors']} tensors ({info['bytes'] / 2**20:.2f} MiB) to {info['out']}"
    )
    return 0
