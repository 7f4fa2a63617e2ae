"""What a finished (or running) trial looks like to readers: the trial table and the report.

A run directory, written by `altgrad.train.Trainer` and knowing nothing of Ray, holds:

- `config.yaml`      the validated RunConfig
- `metrics.jsonl`    one flat JSON object of floats per logged step (`step`, `train/loss`, ...;
                     `val/loss` carries the latest evaluation, whose step is `val/step`)
- `events.jsonl`     `{"step", "kind", "message", ...}` per stability event / format shift / resume
- `summary.json`     `{"status", "stop_reason", "steps", "best_val_loss", "final_val_loss",
                     "collapse_step", "collapse_where", "wall_time_s", ...}`, rewritten as it goes
- `checkpoints/`     `step_XXXXXXXX/checkpoint.pt` (best + last N), `anomaly_step_XXXXXXXX/`

`TrialRecord` is the in-memory view of one trial of a sweep: its grid coordinates plus the
contents of its run directory. Readers (`trials`, `report`) work on records only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOP_REASONS = ("completed", "asha", "nan", "bit_stall", "error")


@dataclass
class TrialRecord:
    trial_id: str
    format: str  # "bf16" for the baseline
    optimizer: str
    precision: str  # "all" | "mlp" | "attn" | "no_head" | a custom policy's name
    seed: int = 0
    status: str = "PENDING"  # Ray's: PENDING / RUNNING / PAUSED / TERMINATED / ERROR
    stop_reason: str | None = None  # one of STOP_REASONS once the trial has ended
    history: list[dict[str, float]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)  # every sampled hyper-parameter
    trial_dir: Path | None = None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the history, skipping rows that lack it."""
        rows = [r for r in self.history if key in r]
        return [int(r["step"]) for r in rows], [float(r[key]) for r in rows]

    def val_series(self) -> tuple[list[int], list[float]]:
        """Validation loss at the steps where it was actually evaluated."""
        rows = [r for r in self.history if "val/loss" in r and r.get("val/step") == r["step"]]
        return [int(r["step"]) for r in rows], [float(r["val/loss"]) for r in rows]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a JSON-lines file, tolerating a torn last line (a run killed mid-write)."""
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return rows
