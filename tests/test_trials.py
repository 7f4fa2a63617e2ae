"""The trial table from an experiment directory alone (no Ray): `load_experiment` and
`python -m altgrad trials`."""

from __future__ import annotations

import csv
import io
import json
import math
import socket
import subprocess
import sys
import time

import pytest

from altgrad.__main__ import main
from altgrad.experiment import (
    ASHA_FILE,
    RUN_DIR,
    STATE_DIR,
    STOPPER_FILE,
    SWEEP_FILE,
    TRIALS_DIR,
    TRIALS_FILE,
    ExperimentError,
    driver_alive,
    load_experiment,
)
from altgrad.tune.heartbeat import DriverHeartbeat
from altgrad.tune.store import StateStore

KEYS = ["bf16-adamw-all-s1", "e4m3-adamw-all-s1", "e7m0-adamw-all-s1", "e5m2-adamw-all-s1",
        "e2m5-adamw-all-s1", "e3m4-adamw-all-s1"]


def labels(key: str) -> dict:
    fmt, opt, prec, seed = key.split("-")
    return {"key": key, "format": fmt, "optimizer": opt, "precision": prec, "seed": int(seed[1:]),
            "params": {}}


def write_run(trial_dir, last_step: int, summary: dict | None, nan_from: int | None = None):
    run = trial_dir / RUN_DIR
    run.mkdir(parents=True)
    rows = []
    for s in range(1, last_step + 1):
        broken = nan_from is not None and s >= nan_from
        rows.append({"step": s, "train/loss": math.nan if broken else 6 - s / 10,
                     "val/loss": math.inf if broken else 6 - (s // 5) / 5, "val/step": s // 5 * 5 or 1,
                     "quant/bit_stall_rate": s / 100, "quant/overflow_rate": 0.001 * s,
                     **({"shadow/cos_mean": 1 - s / 1000} if s % 5 == 0 else {})})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "events.jsonl").write_text(json.dumps({"step": 3, "kind": "resume", "message": "x"}) + "\n")
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def experiment(tmp_path):
    """Six grid points: completed, cut by ASHA at 10 (the trainer ran on to 12), stopped by the
    stopper for NaN at 8, still running, errored, and never started."""
    exp = tmp_path / "exp"
    state = exp / STATE_DIR
    state.mkdir(parents=True)
    trials = {}
    for i, (key, status) in enumerate(zip(KEYS[:5], ["TERMINATED", "TERMINATED", "TERMINATED",
                                                     "RUNNING", "ERROR"], strict=True)):
        trials[f"t{i}"] = {**labels(key), "dir": f"{key}_t{i}", "status": status, "failures": 0,
                           "error": "RuntimeError: boom" if status == "ERROR" else None}
    home = exp / TRIALS_DIR
    write_run(home / KEYS[0], 20, {"status": "finished", "stop_reason": "completed", "steps": 20,
                                              "best_val_loss": 2.0, "wall_time_s": 12.5})
    write_run(home / KEYS[1], 12, {"status": "running", "steps": 10, "best_val_loss": 5.6})
    write_run(home / KEYS[2], 9, {"status": "running", "steps": 5}, nan_from=4)
    write_run(home / KEYS[3], 7, {"status": "running", "steps": 5, "best_val_loss": 9.0})
    write_run(home / KEYS[4], 3, None)
    (state / TRIALS_FILE).write_text(json.dumps(trials))
    (state / ASHA_FILE).write_text(json.dumps({"rungs": {}, "stopped": {"t1": {"step": 10, "rung": 10}}}))
    (state / STOPPER_FILE).write_text(json.dumps({"stopped": {"t2": {"reason": "nan", "step": 8}}}))
    (state / SWEEP_FILE).write_text(json.dumps({
        "status": "running", "points": [labels(k) for k in KEYS], "resume_command": "python x --resume",
        "driver": {"pid": 2**22 + 12345, "host": socket.gethostname()}}))
    return exp


def test_load_experiment(experiment):
    records = load_experiment(experiment)
    assert [r.key for r in records] == KEYS
    assert [r.status for r in records] == ["TERMINATED", "TERMINATED", "TERMINATED", "RUNNING", "ERROR", "PENDING"]
    assert [r.stop_reason for r in records] == ["completed", "asha", "nan", None, "error", None]
    cut = records[1]
    assert cut.stop_step == 10 and cut.history[-1]["step"] == 10  # cut at the decision, not at 12
    assert cut.summary["steps"] == 10 and cut.summary["stop_reason"] == "asha"
    assert cut.summary["best_val_loss"] == pytest.approx(5.6)
    nan = records[2]
    assert nan.summary["best_val_loss"] == pytest.approx(6.0) and nan.summary["final_val_loss"] == math.inf
    assert records[4].error == "RuntimeError: boom"


def test_not_an_experiment(tmp_path, capsys):
    with pytest.raises(ExperimentError, match="not an AltGrad experiment"):
        load_experiment(tmp_path)
    assert main(["trials", str(tmp_path / "nope")]) == 2
    assert "not an AltGrad experiment (does not exist)" in capsys.readouterr().err


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


def test_a_corrupt_trial_is_listed_and_exits_2(experiment, capsys):
    metrics = experiment / TRIALS_DIR / KEYS[0] / RUN_DIR / "metrics.jsonl"
    metrics.write_text("{broken\n" + metrics.read_text())
    assert main(["trials", str(experiment), "--json"]) == 2
    out, err = capsys.readouterr()
    rows = {r["trial"]: r for r in json.loads(out)}
    assert len(rows) == 6 and rows[KEYS[0]]["error"].startswith("unreadable: ")
    assert rows[KEYS[1]]["stop_reason"] == "asha"
    assert KEYS[0] in err


# `python -m altgrad trials EXP`, then the names of the top-level packages it loaded on stderr.
RUN_AS_MAIN = """
import runpy, sys
sys.argv = ["altgrad", "trials", sys.argv[1]]
try:
    runpy.run_module("altgrad", run_name="__main__", alter_sys=True)
finally:
    print("loaded:", *sorted({m.split(".")[0] for m in sys.modules}), file=sys.stderr)
"""


def test_trials_command_imports_neither_torch_nor_ray(experiment):
    """The table is read while a sweep runs: `python -m altgrad trials` must not load torch or Ray."""
    proc = subprocess.run([sys.executable, "-c", RUN_AS_MAIN, str(experiment)],
                          capture_output=True, text=True, timeout=60)
    assert "stop reason" in proc.stdout
    loaded = proc.stderr.rsplit("loaded:", 1)[1].split()
    assert "altgrad" in loaded
    assert "torch" not in loaded and "ray" not in loaded


def test_a_driver_on_another_host_is_alive_while_its_heartbeat_is_fresh(tmp_path):
    """A sweep whose head node was lost can be resumed from a new head once the beat is stale."""
    store = StateStore(str(tmp_path))
    store.write(SWEEP_FILE, {"status": "running",
                             "driver": {"pid": 1, "host": "lost-head", "beat": time.time() - 3600}})
    assert not driver_alive(store.read(SWEEP_FILE)["driver"])
    DriverHeartbeat(store).on_step(0, [])
    assert driver_alive(store.read(SWEEP_FILE)["driver"])
