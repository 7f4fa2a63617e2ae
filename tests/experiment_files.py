"""An experiment directory as a sweep leaves it, written by hand: what the tests of its readers
(`load_experiment`, the trial table, `python -m altgrad trials`) read."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

from altgrad.experiment import (
    ASHA_FILE,
    RUN_DIR,
    STATE_DIR,
    STOPPER_FILE,
    SWEEP_FILE,
    TRIALS_DIR,
    TRIALS_FILE,
)

KEYS = ["bf16-adamw-all-s1", "e4m3-adamw-all-s1", "e7m0-adamw-all-s1", "e5m2-adamw-all-s1",
        "e2m5-adamw-all-s1", "e3m4-adamw-all-s1"]


def labels(key: str) -> dict:
    fmt, opt, prec, seed = key.split("-")
    return {"key": key, "format": fmt, "optimizer": opt, "precision": prec, "seed": int(seed[1:]),
            "params": {}}


def write_run(trial_dir: Path, last_step: int, summary: dict | None, nan_from: int | None = None) -> None:
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


def six_trial_experiment(tmp_path: Path) -> Path:
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
