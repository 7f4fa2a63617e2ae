"""The trial table (`altgrad.trial_table`) of an experiment directory: the text table with its
sweep line and counts, and its JSON and CSV forms."""

from __future__ import annotations

import csv
import io
import json

import pytest

from altgrad.__main__ import main


def test_trials_table_csv_json(experiment, capsys):
    assert main(["trials", str(experiment)]) == 0
    out = capsys.readouterr().out
    assert "interrupted (its driver is gone)" in out and "resume with: python x --resume" in out
    for header in ("stop reason", "best val loss", "bit-stall", "overflow", "shadow cos", "wall time"):
        assert header in out
    assert "6 trials: ERROR 1, PENDING 1, RUNNING 1, TERMINATED 3; stopped: asha 1, completed 1, error 1, nan 1" in out

    assert main(["trials", str(experiment), "--json"]) == 0
    rows = {r["trial"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["e4m3-adamw-all-s1"]["steps"] == 10
    assert rows["e4m3-adamw-all-s1"]["bit_stall"] == pytest.approx(0.10)  # at the stop
    assert rows["e4m3-adamw-all-s1"]["shadow_cos"] == pytest.approx(0.99)
    assert rows["e5m2-adamw-all-s1"]["steps"] == 7  # running: from its history, not the summary
    assert rows["e5m2-adamw-all-s1"]["best_val_loss"] == pytest.approx(5.8)
    assert rows["bf16-adamw-all-s1"]["wall_time_s"] == 12.5

    assert main(["trials", str(experiment), "--csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["stop_reason"] for r in table] == ["completed", "asha", "nan", "", "error", ""]
