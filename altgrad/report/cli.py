"""`python -m altgrad report <experiment> [--out DIR]`: plots + report.md of a sweep (SPEC §8).

Works on a running or interrupted sweep (the report says what is missing), local or on `s3://`
(the files it reads are fetched; without --out the report goes next to the experiment, in the
bucket). Exit 2 with a message when the path is not an experiment, no trial has data yet, or a
trial's files cannot be read.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from altgrad.experiment import REPORT_DIR
from altgrad.remote import cannot, is_remote, join, storage_errors, upload_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report", help="plots and report.md for a sweep (works while it runs)",
        description="Plots and report.md of a sweep: the sweet-spot format per layer precision, how "
                    "formats fail, manifold vs adamw, and the verdict 'E5M2 within 10 % of BF16'.")
    p.add_argument("experiment", help="the experiment directory (or s3://…) a sweep printed")
    # a string: Path("s3://bucket/r") is "s3:/bucket/r", a local folder named "s3:"
    p.add_argument("--out", metavar="DIR", help="output folder, or s3://… (default: <experiment>/report)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported on use, so that the other sub-commands do not pay for matplotlib.
    from altgrad.experiment import ExperimentError, read_experiment

    try:
        experiment = read_experiment(args.experiment)
    except ExperimentError as e:
        return _fail(str(e))
    records = experiment.records
    if not any(r.history for r in records):
        return _fail(f"{args.experiment}: no trial has recorded any metrics yet "
                     f"({len(records)} grid points); run or resume the sweep first")
    out = args.out or join(args.experiment, REPORT_DIR)
    try:
        path = _write(records, out, experiment.name)
    except storage_errors() as e:  # a folder that cannot be made, storage that cannot be reached
        return _fail(cannot(f"write the report to {out}", e))
    print(f"report written: {path}")
    unreadable = [r for r in records if r.unreadable]
    for r in unreadable:
        print(f"error: {r.key}: {r.unreadable}", file=sys.stderr)
    return 2 if unreadable else 0


def report_after_sweep(experiment: str, name: str) -> int:
    """A sweep entry point's last step: the report of the experiment it ran, into
    `<experiment>/report/`. 0 when written, 1 (with the command that retries it) when not: the
    sweep's data is safe either way."""
    from altgrad.experiment import read_experiment

    out = join(experiment, REPORT_DIR)
    try:
        path = _write(read_experiment(experiment).records, out, name)
    except Exception as e:  # noqa: BLE001 - any failure: say how to retry the report alone
        print(f"report failed ({type(e).__name__}: {e}); retry: python -m altgrad report {shlex.quote(experiment)}")
        return 1
    print(f"report: {path}")
    return 0


def _write(records: list, out: str | Path, name: str) -> str:
    """The report of `records` written to `out`, a local folder or a remote one (written locally,
    then uploaded); returns where report.md is."""
    from altgrad.report import write_report

    title = f"AltGrad report: {name}"
    if not is_remote(out):
        return str(write_report(records, Path(out), title=title))
    with tempfile.TemporaryDirectory(prefix="altgrad-report-") as tmp:
        path = write_report(records, Path(tmp), title=title)
        upload_dir(Path(tmp), str(out))
    return join(out, path.name)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
