"""`flwr-sharded export`: the command line of `checkpoint.export_pretrained` (torch is imported when it runs)."""

from __future__ import annotations

import argparse
import sys

from flwr_sharded.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `export` sub-command."""
    parser = subparsers.add_parser("export", help="merge a checkpoint's shards into a Hugging Face model",
                                   description="Write the model of a sharded checkpoint as a Hugging Face model, one "
                                   "tensor at a time.")
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory (step-N) or a group's series (uses its newest)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="dtype of the written tensors (default: as in the checkpoint)")
    parser.set_defaults(func=_export_command)


def _export_command(args: argparse.Namespace) -> int:
    import torch

    from flwr_sharded.training.checkpoint import export_pretrained

    try:
        path = export_pretrained(args.checkpoint, args.out, dtype=getattr(torch, args.dtype) if args.dtype else None)
    except ConfigError as exc:
        print(f"flwr-sharded export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
