"""The files of a run directory other than checkpoints: config, metrics, events, summary.

Readers (`python -m altgrad trials`, the report) parse these while the run is still going, so
JSON-lines are appended whole and `summary.json` is replaced atomically. Non-finite floats are
written as Python's json writes them (`NaN`, `Infinity`), which `json.loads` reads back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from altgrad.experiment import CONFIG_FILE, EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, read_jsonl
from altgrad.metrics import STEP


class RunFileError(RuntimeError):
    """A run file a resume must read is corrupt (not a torn last line, which a kill leaves and
    which is dropped); the message names the file and the line."""


class RunFiles:
    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)
        self.metrics = self.dir / METRICS_FILE
        self.events = self.dir / EVENTS_FILE
        self.summary = self.dir / SUMMARY_FILE
        self.config = self.dir / CONFIG_FILE
        self.logs = [self.metrics, self.events]  # the JSON-lines files a step appends to (`log`)

    def log(self, path: Path) -> Path:
        """Another JSON-lines file of the run, started and resumed with the others."""
        self.logs.append(path)
        return path

    def start(self, config_yaml: str, resume_step: int | None) -> None:
        """Create the run dir; on resume, drop every log's rows after the checkpoint (they will be
        redone). Every log is read before any is rewritten, and the config written last: a resume
        refused for a corrupt file leaves the run as it was."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            for f in self.logs:
                f.unlink(missing_ok=True)
        else:
            kept = {f: [r for r in self._rows(f, resume_step) if int(r.get(STEP, 0)) <= resume_step]
                    for f in self.logs if f.exists()}
            for f, rows in kept.items():  # (a file the run never wrote stays unwritten)
                tmp = f.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
                os.replace(tmp, f)
        self.config.write_text(config_yaml)

    @staticmethod
    def _rows(path: Path, step: int) -> list[dict[str, Any]]:
        try:
            return read_jsonl(path)
        except ValueError as e:  # (a line that is not JSON, before the last)
            raise RunFileError(f"cannot resume: {e}; the run keeps its rows up to step {step}: mend or "
                               "remove that line and resume again") from None

    def append(self, path: Path, row: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def log_metrics(self, metrics: dict[str, float]) -> None:
        self.append(self.metrics, metrics)

    def log_event(self, step: int, kind: str, message: str, **extra: Any) -> dict[str, Any]:
        event = {STEP: step, "kind": kind, "message": message, **extra}
        self.append(self.events, event)
        return event

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.summary.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, self.summary)
