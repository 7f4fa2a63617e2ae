"""What the tests read from W&B's local run files, on top of `altgrad.tune.wandb_files`."""

from __future__ import annotations

import json
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

from altgrad.tune.wandb_files import history_steps, run_logs

__all__ = ["alerts", "history_rows", "history_steps", "offline_runs"]


def offline_runs(directory: Path) -> dict[str, list[list[pb.Record]]]:
    return run_logs(directory)


def history_rows(attempts: list[list[pb.Record]]) -> dict[int, dict[str, float]]:
    """step -> the logged values (numbers) of that step."""
    return {r.history.step.num: {"/".join(i.nested_key) or i.key: float(json.loads(i.value_json))
                                 for i in r.history.item if _number(i.value_json)}
            for recs in attempts for r in recs if r.HasField("history")}


def _number(value_json: str) -> bool:
    return value_json in ("NaN", "Infinity", "-Infinity") or isinstance(json.loads(value_json), int | float)


def alerts(attempts: list[list[pb.Record]]) -> list[pb.AlertRecord]:
    return [r.alert for recs in attempts for r in recs if r.HasField("alert")]
