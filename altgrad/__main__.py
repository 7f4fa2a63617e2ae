"""`python -m altgrad {train,trials,report} ...`: one entry point, one module per sub-command.

Each sub-command module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int` (the exit code). User-caused errors exit 2 with a message, never a traceback.
Only the named sub-command's module is imported: `trials` must start fast and without torch or Ray
(it is read while a sweep runs); the full set is imported only to list them (`--help`, a typo).
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
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m altgrad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    named = next((a for a in argv if not a.startswith("-")), None)
    for name, module in SUBCOMMANDS.items():
        if named not in SUBCOMMANDS or name == named:
            importlib.import_module(module).register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
