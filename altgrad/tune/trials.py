"""`python -m altgrad trials <experiment> [--csv | --json]`: the trial table of a sweep.

Reads the experiment directory only (`load_experiment`), so it works while the sweep runs, after it
was killed, and on a machine without Ray running. One row per trial: where it sits in the grid, its
status and stop reason, and the numbers that say how it trained. Exit 2 when the path is not an
experiment, or when some trial's files are corrupt (the table still lists the others).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from altgrad.experiment import (
    STATE_DIR,
    SWEEP_FILE,
    ExperimentError,
    TrialRecord,
    axis_names,
    load_experiment,
    read_json,
)
from altgrad.remote import readable

# The text table's columns (extra grid axes go after `precision`, `same_as` last when present).
COLUMNS = ("trial", "format", "optimizer", "precision", "status", "stop_reason", "steps",
           "best_val_loss", "bit_stall", "overflow", "shadow_cos", "wall_time_s")
# The driver refreshes `driver.beat` in sweep.json this often (`heartbeat.DriverHeartbeat`); a
# driver on another host whose beat is older than STALE_S is taken for gone (its node was lost).
BEAT_S, STALE_S = 30.0, 90.0
HEADERS = ("trial", "format", "optimizer", "precision", "status", "stop reason", "steps",
           "best val loss", "bit-stall", "overflow", "shadow cos", "wall time")


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
        with readable(args.experiment) as exp_dir:
            records = load_experiment(exp_dir)
            banner = sweep_banner(args.experiment, exp_dir, records)
    except ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # remote storage unreachable, or no permission
        print(f"error: cannot read {args.experiment}: {e}", file=sys.stderr)
        return 2
    rows = [trial_row(r) for r in records]
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.csv:
        print(to_csv(rows), end="")
    else:
        print(banner)
        print(render_table(rows))
    unreadable = [r.key for r in records if r.unreadable]
    if unreadable:
        print(f"error: unreadable trial files: {', '.join(unreadable)}", file=sys.stderr)
        return 2
    return 0


def trial_row(r: TrialRecord) -> dict[str, Any]:
    """The table's numbers for one trial: best val loss, and the last bit-stall, overflow and
    FP32-shadow cosine it logged (up to its stop, for a trial the sweep stopped). A running trial's
    summary lags at its last checkpoint, so its steps and best loss come from its history."""
    last = r.history[-1] if r.history else {}
    if r.summary.get("status") == "finished":
        steps, best = r.summary.get("steps"), r.summary.get("best_val_loss")
    else:
        finite = [v for v in r.val_series()[1] if math.isfinite(v)]
        steps, best = (int(last["step"]) if last else 0), min(finite, default=None)
    return {
        "trial": r.key, "trial_id": r.trial_id, "format": r.format, "optimizer": r.optimizer,
        "precision": r.precision, **r.axes, "seed": r.seed,
        **{f"param_{k}": v for k, v in r.params.items()},
        "status": r.status, "stop_reason": r.stop_reason, "stop_detail": r.stop_detail,
        "steps": steps, "best_val_loss": best,
        "bit_stall": _last(r.history, "quant/bit_stall_rate"),
        "overflow": _last(r.history, "quant/overflow_rate"),
        "shadow_cos": _last(r.history, "shadow/cos_mean"),
        "wall_time_s": r.summary.get("wall_time_s"),
        "error": f"unreadable: {r.unreadable}" if r.unreadable else r.error,
        "same_as": r.same_as,
    }


def _last(history: list[dict[str, Any]], key: str) -> float | None:
    return next((row[key] for row in reversed(history) if key in row), None)


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column in ("bit_stall", "overflow"):
        return f"{100 * value:.2f}%"
    if column == "wall_time_s":
        return f"{value:.0f}s" if value < 100 else f"{value / 60:.1f}m"
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def render_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table, one line per trial (a column per extra grid axis), then a count
    per status and stop reason. A stop shows its numbers; an alias row (an equivalent format, not
    run again) names the trial that measured it."""
    axes = list(dict.fromkeys(k for row in rows for k in row if "." in k))  # dotted RunConfig paths
    at = COLUMNS.index("precision") + 1
    columns = [*COLUMNS[:at], *axes, *COLUMNS[at:]]
    headers = [*HEADERS[:at], *axis_names(axes).values(), *HEADERS[at:]]
    if any(row.get("same_as") for row in rows):
        columns.append("same_as")
        headers.append("one measurement with")
    cells = [[_cell(c, row.get("stop_detail") or row[c] if c == "stop_reason" else row.get(c))
              for c in columns] for row in rows]
    widths = [max([len(h), *(len(line[i]) for line in cells)]) for i, h in enumerate(headers)]
    numeric = {columns.index(c) for c in ("steps", "best_val_loss", "bit_stall", "overflow",
                                           "shadow_cos", "wall_time_s")}

    def line(values: list[str] | tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if i in numeric else v.ljust(w)
                         for i, (v, w) in enumerate(zip(values, widths, strict=True))).rstrip()

    out = [line(headers), line(["-" * w for w in widths]), *(line(c) for c in cells)]
    out.append(_counts(rows))
    errors = [f"  {row['trial']}: {row['error']}" for row in rows if row.get("error")]
    if errors:
        out += ["errors:", *errors]
    return "\n".join(out)


def _counts(rows: list[dict[str, Any]]) -> str:
    """Counts over the trials that ran (an alias row repeats a measurement; it is not counted)."""
    measured = [row for row in rows if not row.get("same_as")]

    def count(key: str) -> str:
        values = [str(row[key]) for row in measured if row[key] is not None]
        return ", ".join(f"{v} {values.count(v)}" for v in sorted(set(values)))

    aliases = len(rows) - len(measured)
    also = f" (+{aliases} listed under an equivalent format)" if aliases else ""
    return f"{len(measured)} trials{also}: {count('status')}" + (
        f"; stopped: {count('stop_reason')}" if any(r["stop_reason"] for r in measured) else "")


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    fields = list(dict.fromkeys(k for row in rows for k in row))
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def sweep_banner(experiment: str | Path, exp_dir: Path, records: list[TrialRecord]) -> str:
    """One line: the sweep's state and, when it stopped before the end, how to resume it
    (`experiment` as the user named it, `exp_dir` where its files were read)."""
    sweep = read_json(Path(exp_dir) / STATE_DIR / SWEEP_FILE)
    status = sweep.get("status", "unknown")
    if status == "running" and not driver_alive(sweep.get("driver", {})):
        status = "interrupted (its driver is gone)"
    text = f"experiment {experiment}: {status}"
    unfinished = any(r.status != "TERMINATED" for r in records)
    if status != "running" and unfinished and sweep.get("resume_command"):
        text += f"\nresume with: {sweep['resume_command']}"
    return text


def driver_alive(driver: dict[str, Any]) -> bool:
    """On this host: its pid exists. On another (a cluster head): its heartbeat is recent."""
    if driver.get("host") != socket.gethostname():
        return time.time() - float(driver.get("beat", 0)) < STALE_S
    try:
        os.kill(int(driver["pid"]), 0)
    except (KeyError, ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True
