"""The trial table (`altgrad.trial_table`) of an experiment directory: the text table with its
sweep line and counts, and its JSON and CSV forms."""

from __future__ import annotations

import csv
import io
import json

import pytest
from experiment_files import KEYS

from altgrad.__main__ import main
from altgrad.experiment import RUN_DIR, TRIALS_DIR


def test_trials_table_csv_json(experiment, capsys):
    assert main(["trials", str(experiment)]) == 0
    out = capsys.readouterr().out
    assert "interrupted (its driver is gone)" in out and "resume with: python x --resume" in out
    for header in ("stop reason", "best val loss", "bit-stall", "overflow", "shadow cos", "wall time"):
        assert header in out
    # the trial Ray last listed as RUNNING stopped with its driver: PAUSED, resumed with the sweep
    assert "6 trials: ERROR 1, PAUSED 1, PENDING 1, TERMINATED 3; stopped: asha 1, completed 1, error 1, nan 1" in out

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


def test_a_trial_that_shifted_formats_says_how_often(experiment, capsys):
    """An emergency mantissa shift (SPEC §6) moves layers to another format mid-run: the table
    gains a column with each trial's shifts up to its stop (here ASHA's, at step 10: the trainer's
    second shift at 11 is past it), and its format is no longer the only one it ran."""
    events = experiment / TRIALS_DIR / KEYS[1] / RUN_DIR / "events.jsonl"
    with events.open("a") as f:  # as the trainer writes them (`altgrad.train.format_shift`)
        for step, layer in ((6, "lm_head"), (11, "h.0.mlp.c_fc")):
            f.write(json.dumps({"step": step, "kind": "format_shift", "message": "...", "layer": layer,
                                "from": "e4m3", "to": "e3m4", "reason": "nan"}) + "\n")
    assert main(["trials", str(experiment), "--json"]) == 0
    shifts = {r["trial"]: r["format_shifts"] for r in json.loads(capsys.readouterr().out)}
    assert shifts[KEYS[1]] == 1 and shifts[KEYS[0]] == 0
    assert main(["trials", str(experiment)]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("trial "))
    lines = out[out.index(header) + 2:]
    at = header.index("format shifts")
    assert header.index("shadow cos") < at < header.index("wall time")
    row = next(line for line in lines if line.startswith(KEYS[1]))
    assert row[at:at + len("format shifts")].strip() == "1"


def test_a_running_trial_of_a_live_sweep_stays_running_and_an_interrupted_ones_report_says_so(
        experiment, tmp_path, capsys):
    """RUNNING in Ray's last snapshot means running only while the sweep's driver lives; the report
    of an interrupted sweep calls its unfinished trial interrupted, not still running."""
    import os

    from altgrad.experiment import STATE_DIR, SWEEP_FILE

    assert main(["report", str(experiment), "--out", str(tmp_path / "report")]) == 0
    assert "interrupted at step 7, numbers provisional" in (tmp_path / "report" / "report.md").read_text()
    sweep = experiment / STATE_DIR / SWEEP_FILE
    doc = json.loads(sweep.read_text())
    sweep.write_text(json.dumps({**doc, "driver": {**doc["driver"], "pid": os.getpid()}}))
    assert main(["trials", str(experiment)]) == 0
    out = capsys.readouterr().out
    assert "experiment" in out and ": running" in out and "PENDING 1, RUNNING 1, TERMINATED 3" in out
