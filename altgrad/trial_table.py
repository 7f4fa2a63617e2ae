"""The trial table: one row per trial of a sweep, as text, CSV or JSON, and the sweep's state line.

Built from `TrialRecord`s only (`altgrad.experiment`), so the `trials` command, the sweep's final
printout and the tests share it without importing either the CLI or Ray. A row says where the trial
sits in the grid, its status and stop reason, and the numbers that say how it trained.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from altgrad.experiment import (
    RunStatus,
    SweepStatus,
    TrialRecord,
    TrialStatus,
    axis_names,
    sweep_alive,
)
from altgrad.metrics import BIT_STALL_RATE, OVERFLOW_RATE, SHADOW_COS_MEAN, STEP

# The text table's columns (extra grid axes go after `precision`, `same_as` last when present).
COLUMNS = ("trial", "format", "optimizer", "precision", "status", "stop_reason", "steps",
           "best_val_loss", "bit_stall", "overflow", "shadow_cos", "wall_time_s")
HEADERS = ("trial", "format", "optimizer", "precision", "status", "stop reason", "steps",
           "best val loss", "bit-stall", "overflow", "shadow cos", "wall time")


def trial_row(r: TrialRecord) -> dict[str, Any]:
    """The table's numbers for one trial: best val loss, and the last bit-stall, overflow and
    FP32-shadow cosine it logged (up to its stop, for a trial the sweep stopped). A running trial's
    summary lags at its last checkpoint, so its steps and best loss come from its history."""
    last = r.history[-1] if r.history else {}
    if r.summary.get("status") == RunStatus.FINISHED:
        steps, best = r.summary.get("steps"), r.summary.get("best_val_loss")
    else:
        steps, best = (int(last[STEP]) if last else 0), r.best_val_loss()
        best = best if math.isfinite(best) else None
    return {
        "trial": r.key, "trial_id": r.trial_id, "format": r.format, "optimizer": r.optimizer,
        "precision": r.precision, **r.axes, "seed": r.seed,
        **{f"param_{k}": v for k, v in r.params.items()},
        "status": r.status, "stop_reason": r.stop_reason, "stop_detail": r.stop_detail,
        "steps": steps, "best_val_loss": best,
        "bit_stall": _last(r.history, BIT_STALL_RATE),
        "overflow": _last(r.history, OVERFLOW_RATE),
        "shadow_cos": _last(r.history, SHADOW_COS_MEAN),
        "format_shifts": len(r.format_shifts) if r.history else None,
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
    if column == "format_shifts":
        return f"{value:.0f}"
    if column == "wall_time_s":
        return f"{value:.0f}s" if value < 100 else f"{value / 60:.1f}m"
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def render_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table, one line per trial (a column per extra grid axis), then a count
    per status and stop reason. A stop shows its numbers; an alias row (an equivalent format, not
    run again) names the trial that measured it; where a trial shifted layers to another format
    (SPEC §6), a column says how many shifts, since its format is then not the only one it ran."""
    axes = list(dict.fromkeys(k for row in rows for k in row if "." in k))  # dotted RunConfig paths
    at = COLUMNS.index("precision") + 1
    columns = [*COLUMNS[:at], *axes, *COLUMNS[at:]]
    headers = [*HEADERS[:at], *axis_names(axes).values(), *HEADERS[at:]]
    if any(row.get("format_shifts") for row in rows):
        at = columns.index("wall_time_s")
        columns.insert(at, "format_shifts")
        headers.insert(at, "format shifts")
    if any(row.get("same_as") for row in rows):
        columns.append("same_as")
        headers.append("one measurement with")
    cells = [[_cell(c, row.get("stop_detail") or row[c] if c == "stop_reason" else row.get(c))
              for c in columns] for row in rows]
    widths = [max([len(h), *(len(line[i]) for line in cells)]) for i, h in enumerate(headers)]
    numeric = {columns.index(c) for c in ("steps", "best_val_loss", "bit_stall", "overflow",
                                           "shadow_cos", "format_shifts", "wall_time_s") if c in columns}

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
    also = f" (+{aliases} listed under an equivalent format or precision)" if aliases else ""
    return f"{len(measured)} trials{also}: {count('status')}" + (
        f"; stopped: {count('stop_reason')}" if any(r["stop_reason"] for r in measured) else "")


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    fields = list(dict.fromkeys(k for row in rows for k in row))
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def sweep_banner(experiment: str | Path, sweep: dict[str, Any], records: list[TrialRecord]) -> str:
    """One line: the sweep's state (from its `sweep.json`) and, when it stopped before the end, how
    to resume it (`experiment` as the user named it)."""
    status = sweep.get("status", "unknown")
    if status == SweepStatus.RUNNING and not sweep_alive(sweep):
        status = "interrupted (its driver is gone)"
    text = f"experiment {experiment}: {status}"
    unfinished = any(r.status != TrialStatus.TERMINATED for r in records)
    if status != SweepStatus.RUNNING and unfinished and sweep.get("resume_command"):
        text += f"\nresume with: {sweep['resume_command']}"
    return text
