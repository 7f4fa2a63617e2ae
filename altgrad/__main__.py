"""`python -m altgrad {train,trials,report} ...`: one entry point, one module per sub-command.

Each sub-command module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int` (the exit code). User-caused errors exit 2 with a message, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "train": "altgrad.train.cli",
    "trials": "altgrad.tune.trials",
    "report": "altgrad.report.cli",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m altgrad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
