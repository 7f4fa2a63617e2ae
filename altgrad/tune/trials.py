"""`python -m altgrad trials <experiment> [--csv | --json]`: the trial table of a sweep.

Reads the experiment directory only (`read_experiment`), so it works while the sweep runs, after it
was killed, and on a machine without Ray running. One row per trial: where it sits in the grid, its
status and stop reason, and the numbers that say how it trained. Exit 2 when the path is not an
experiment or cannot be read, or when some trial's files are corrupt (the table still lists the
others).
"""

from __future__ import annotations

import argparse
import json
import sys

from altgrad.experiment import ExperimentError, read_experiment
from altgrad.trial_table import render_table, sweep_banner, to_csv, trial_row


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trials", help="the trial table of a sweep (works while it runs)")
    p.add_argument("experiment", help="experiment directory (or s3://bucket/prefix/<name>), e.g. "
                                      "experiments/format_ablation")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="CSV on stdout")
    fmt.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        experiment = read_experiment(args.experiment)
    except ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    records = experiment.records
    rows = [trial_row(r) for r in records]
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.csv:
        print(to_csv(rows), end="")
    else:
        print(sweep_banner(args.experiment, experiment.sweep, records))
        print(render_table(rows))
    unreadable = [r.key for r in records if r.unreadable]
    if unreadable:
        print(f"error: unreadable trial files: {', '.join(unreadable)}", file=sys.stderr)
        return 2
    return 0
