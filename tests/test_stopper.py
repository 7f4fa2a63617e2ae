"""The stability stopper (`altgrad.tune.stopper`) without Ray running: NaN and bit-stall stops,
replayed after a restore, at the cpu preset's diagnostic cadence."""

from __future__ import annotations

import json

import pytest
from sweep_helpers import pickle_roundtrip

from altgrad.config import StabilityConfig, build_run_config
from altgrad.experiment import STATE_DIR, STOPPER_FILE, stop_detail
from altgrad.metrics import STALL_STREAK
from altgrad.train.stability import stall_halts_learning
from altgrad.tune.config import SweepConfig
from altgrad.tune.stopper import StabilityStopper
from altgrad.tune.store import StateStore
from altgrad.tune.trainable import SweepSignals


def test_stopper_stops_for_nan_and_bit_stall_and_replays(tmp_path):
    store = StateStore(str(tmp_path))
    limits = StabilityConfig(nan_patience=3, stall_stop_reports=4, stall_stop=0.9)
    stopper = StabilityStopper(store, {"p": limits})
    point = {"config": {"key": "p"}}  # every trial here runs grid point p
    assert not stopper("n", {**point, "step": 7, "stability/nan_streak": 2.0})
    assert stopper("n", {**point, "step": 8, "stability/nan_streak": 3.0})
    assert not stopper("s", {**point, "step": 5, STALL_STREAK: 3.0})
    assert stopper("s", {**point, "step": 6, STALL_STREAK: 4.0})
    assert not stopper("ok", {**point, "step": 6, STALL_STREAK: 0.0, "stability/nan_streak": 0.0})
    restored = pickle_roundtrip(stopper)
    assert not restored("n", {**point, "step": 6, "stability/nan_streak": 0.0})  # replay before the stop
    assert restored("n", {**point, "step": 8, "stability/nan_streak": 0.0})  # stopped again, same step
    state = json.loads((tmp_path / STATE_DIR / STOPPER_FILE).read_text())
    assert state["stopped"] == {
        "n": {"reason": "nan", "step": 8, "streak": 3, "patience": 3},
        "s": {"reason": "bit_stall", "step": 6, "streak": 4, "patience": 4, "threshold": 0.9}}
    assert stop_detail(state["stopped"]["s"]).startswith("bit_stall: bit-stall >= 0.9 for 4 reports")


def cpu_sweep(stall_reports: int, **grid: dict) -> SweepConfig:
    """The cpu preset with diagnostics on every 5th step, as the cpu sweep runs it."""
    return SweepConfig.validated({
        "name": "t", "preset": "cpu", "resources": {"gpu_per_trial": 0, "cpus_per_trial": 1},
        "base": {"train": {"diag_every": 5}, "stability": {"stall_stop_reports": stall_reports}},
        "grid": {"formats": ["e7m0"], **grid}})


def cpu_reports(max_steps: int, diag_every: int, stall_from: int):
    """What the trainer reports at the cpu preset: every step; bit-stall (1.0 from `stall_from`
    on) only on step 1 and every `diag_every`-th step."""
    for s in range(1, max_steps + 1):
        row = {"step": float(s), "train/loss": 5.0, "val/loss": 5.0, "val/step": 1.0}
        if s == 1 or s % diag_every == 0:
            row["quant/bit_stall_rate"] = 1.0 if s >= stall_from else 0.2
        yield row


@pytest.mark.parametrize("stall_reports, stall_from, stop_step", [
    (10, 10, 55),  # the 10th stalled diagnostic report: steps 10, 15, ..., 55
    (13, 1, 60),  # the longest window a 60-step run can fill: all 13 diagnostic reports
    (20, 1, None),  # cannot fill: the config warns, and indeed nothing stops
])
def test_bit_stall_stop_at_the_cpu_preset(tmp_path, stall_reports, stall_from, stop_step):
    """Reports without bit-stall neither extend nor break the streak, so the window counts
    diagnostic reports; the config warns exactly when the window cannot fill in a full run."""
    cfg = cpu_sweep(stall_reports)
    run = cfg.run_config({})
    t = run.train
    assert (t.max_steps, t.diag_every, t.log_interval) == (60, 5, 1)
    stopper = StabilityStopper(StateStore(str(tmp_path)), {"p": run.stability})
    signals = SweepSignals(run.stability, 1e-3)
    stopped = next((int(row["step"]) for row in cpu_reports(t.max_steps, t.diag_every, stall_from)
                    if stopper("t1", {**row, **signals.observe(row), "config": {"key": "p"}})), None)
    assert stopped == stop_step
    warning = cfg.stall_window_warning()
    assert (warning is None) == (stop_step is not None)
    if stop_step is None:
        assert "stability.stall_stop_reports (20)" in warning and "at most 13" in warning
    else:
        state = json.loads((tmp_path / STATE_DIR / STOPPER_FILE).read_text())
        assert state["stopped"]["t1"]["reason"] == "bit_stall"
        assert state["stopped"]["t1"]["step"] == stop_step


def test_bit_stall_stops_only_runs_whose_weights_live_in_the_format(tmp_path):
    """With fp32 master weights a stalled 8-bit view still learns: the same fully stalled stream
    that stops a format-stored run leaves an fp32-master run (and bf16) to ASHA's loss test."""
    decisions = {}
    for master in ("fp32", "format"):
        run = build_run_config({}, ["preset=cpu", "quant.format=e7m0", f"quant.master_weights={master}"])
        stopper = StabilityStopper(StateStore(str(tmp_path / master)),
                                   {"p": StabilityConfig(nan_patience=5, stall_stop_reports=4, stall_stop=0.99)})
        signals = SweepSignals(StabilityConfig(), 1e-3, stall_halts_learning(run))
        rows = ({"step": float(s), "val/loss": 5.0, "val/step": 1.0, "quant/bit_stall_rate": 1.0,
                 "config": {"key": "p"}} for s in range(1, 21))
        decisions[master] = next((int(r["step"]) for r in rows if stopper("t", {**r, **signals.observe(r)})), None)
    assert decisions == {"fp32": None, "format": 4}
    assert not stall_halts_learning(build_run_config({}, ["preset=cpu", "quant.format=bf16"]))


def test_each_trial_is_stopped_by_its_own_runs_thresholds(tmp_path):
    """A grid axis over `stability.nan_patience`: the stopper ends each trial at its own run's
    patience, the one its trainer stops at too (the grid builds both from the same run config)."""
    from altgrad.tune.grid import build_grid

    cfg = cpu_sweep(13, optimizers=["adamw"], axes={"stability.nan_patience": [2, 4]})
    points = {p.key: p for p in build_grid(cfg)}
    stopper = StabilityStopper(StateStore(str(tmp_path)), {k: p.run_config.stability for k, p in points.items()})
    stops = {key: next(s for s in range(1, 10) if stopper(key, {"step": s, "stability/nan_streak": float(s),
                                                                "config": {"key": key}}))
             for key in points}
    assert stops == {"e7m0-adamw-all-nan_patience=2-s42": 2, "e7m0-adamw-all-nan_patience=4-s42": 4}
    assert {p.run_config.stability.nan_patience for p in points.values()} == {2, 4}
