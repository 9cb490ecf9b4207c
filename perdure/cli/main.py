"""The `perdure` command: `perdure runs ...` (the run registry), `perdure ckpt ...` (checkpoints), `perdure sweep ...`
(job matrices, locally or on SLURM), `perdure web` (the run viewer) and `perdure ft lighthouse` (TorchFT)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from perdure.errors import PerdureError, show_traceback
from perdure.safe_io import echo

# Each subcommand module exposes `add_parser(subparsers)`; the parser it adds sets `handler(args) -> int`.
SUBCOMMANDS = {
    "runs": "perdure.cli.runs",
    "ckpt": "perdure.cli.ckpt",
    "sweep": "perdure.cli.sweep",
    "web": "perdure.cli.web",
    "ft": "perdure.cli.ft",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="perdure", description="Inspect perdure runs and checkpoints; run sweeps.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except PerdureError as error:
        if show_traceback():
            traceback.print_exc()
        echo(f"error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `perdure ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as error:  # a path the filesystem refuses (a name too long, permissions, ...): no traceback
        where = f": {error.filename}" if error.filename else ""
        echo(f"error: {error.strerror or error}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
