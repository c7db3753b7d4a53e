"""The ``specpilot`` command line: one subcommand per module in ``specpilot.commands``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specpilot import __version__
from specpilot.commands import (
    bench,
    compare,
    generate,
    memory,
    models,
    profile,
    serve,
    train_drafter,
    tune,
    verify,
)
from specpilot.commands.common import check_args
from specpilot.errors import SpecPilotError

COMMANDS = {
    "generate": generate,
    "bench": bench,
    "verify": verify,
    "models": models,
    "serve": serve,
    "profile": profile,
    "tune": tune,
    "memory": memory,
    "compare": compare,
    "train-drafter": train_drafter,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specpilot",
        description="Lossless greedy speculative decoding, measured against plain AR and token-forced.",
    )
    parser.add_argument("--version", action="version", version=f"specpilot {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}"
    )
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = COMMANDS[args.command]
    try:
        for note in check_args(args, module):  # every argument, before anything is loaded
            print(f"specpilot: note: {note}", file=sys.stderr, flush=True)
        return module.run(args)
    except SpecPilotError as e:
        print(f"specpilot: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specpilot: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
