"""Persisted ASHA (`altgrad.tune.asha`) without Ray running: only broken trials stop at a rung,
against bf16 of the same seed, and restored rungs decide like the original."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from sweep_helpers import pickle_roundtrip

from altgrad.experiment import ASHA_FILE, STATE_DIR, stop_detail
from altgrad.tune.asha import StabilityRungs
from altgrad.tune.config import asha_milestones
from altgrad.tune.store import StateStore

STOP, CONTINUE = "STOP", "CONTINUE"


# Trial key -> its bf16 reference (same optimizer and seed), as the grid builds them.
REFERENCES = {"e4m3-s1": "bf16-s1", "e5m2-s1": "bf16-s1", "e7m0-s1": "bf16-s1", "e2m5-s1": "bf16-s1",
              "e3m4-s1": "bf16-s1", "nan-s1": "bf16-s1", "bf16-s1": None,
              "e4m3-s2": "bf16-s2", "bf16-s2": None}


def rungs(store: StateStore, tolerance: float = 0.10) -> StabilityRungs:
    return StabilityRungs(store, metric="val/loss", mode="min", max_t=90, grace_period=10,
                          reduction_factor=3, tolerance=tolerance, references=REFERENCES)


def feed(scheduler: StabilityRungs, trial: str, losses: dict[int, float]) -> list[tuple[int, str]]:
    """Report `losses` (step -> val loss) for one trial (its key is also its id); the decisions."""
    t = SimpleNamespace(trial_id=trial, config={"key": trial})
    return [(step, scheduler.on_trial_result(None, t, {"step": step, "val/loss": v}))
            for step, v in sorted(losses.items())]


def test_milestones():
    assert asha_milestones(10, 3, 90) == [10, 30]  # a rung at the last step could stop nothing
    assert asha_milestones(20, 3, 60) == [20]


def test_only_broken_trials_stop_at_a_rung(tmp_path):
    """1 % and 3 % behind bf16 continue, 30 % behind and NaN stop; the numbers are recorded."""
    store = StateStore(str(tmp_path))
    s = rungs(store)
    assert feed(s, "bf16-s1", {5: 6.0, 10: 5.0}) == [(5, CONTINUE), (10, CONTINUE)]
    assert feed(s, "e4m3-s1", {10: 5.05})[-1] == (10, CONTINUE)  # 1 % behind
    assert feed(s, "e5m2-s1", {10: 5.15})[-1] == (10, CONTINUE)  # 3 % behind
    assert feed(s, "e7m0-s1", {10: 6.5})[-1] == (10, STOP)  # 30 % behind
    assert feed(s, "nan-s1", {10: math.nan})[-1] == (10, STOP)
    assert feed(s, "e4m3-s1", {30: 5.5})[-1] == (30, CONTINUE)  # nothing else at rung 30: no reference
    state = json.loads((tmp_path / STATE_DIR / ASHA_FILE).read_text())
    assert set(state["stopped"]) == {"e7m0-s1", "nan-s1"}
    e7m0 = state["stopped"]["e7m0-s1"]
    assert e7m0["reason"] == "asha" and e7m0["reference_key"] == "bf16-s1"
    assert e7m0["reference"] == 5.0 and e7m0["behind"] == pytest.approx(0.3)
    assert state["stopped"]["nan-s1"]["reason"] == "nan"
    detail = stop_detail(e7m0)
    assert detail.startswith("asha: 30 % behind bf16 at step 10") and "6.5000 vs 5.0000" in detail


def test_a_trial_ahead_of_its_bf16_waits_for_it(tmp_path):
    s = rungs(StateStore(str(tmp_path)), tolerance=0.05)
    assert feed(s, "e4m3-s1", {10: 5.0}) == [(10, CONTINUE)]  # bf16-s1 not at the rung: waits
    assert feed(s, "e3m4-s1", {10: 5.3}) == [(10, CONTINUE)]  # 6 % behind e4m3, but e4m3 is no reference
    assert feed(s, "bf16-s1", {10: 5.2}) == [(10, CONTINUE)]  # judges both: 1.9 % behind at most
    assert feed(s, "e5m2-s1", {10: 5.6}) == [(10, STOP)]  # bf16-s1 there: judged at once, 7.7 % behind
    assert feed(s, "e4m3-s2", {12: 5.6, 20: 5.0}) == [(12, CONTINUE), (20, CONTINUE)]  # waits
    feed(s, "bf16-s2", {10: 5.1})  # judges e4m3-s2 at step 12, where it reached the rung: 9.8 % behind
    assert feed(s, "e4m3-s2", {21: 4.9}) == [(21, STOP)]  # its next report
    assert feed(s, "solo", {10: 6.0}) == [(10, STOP)]  # no bf16 in the grid: the rung's best, 5.0
    state = json.loads((tmp_path / STATE_DIR / ASHA_FILE).read_text())
    assert state["pending"] == {}
    late = state["stopped"]["e4m3-s2"]
    assert (late["step"], late["rung"], late["value"], late["reference"], late["reference_key"]) == \
        (12, 10, 5.6, 5.1, "bf16-s2")
    assert state["stopped"]["solo"]["reference_key"] is None and state["stopped"]["solo"]["reference"] == 5.0
    (tmp_path / STATE_DIR / ASHA_FILE).unlink()  # (the state stays in memory)
    assert feed(s, "e3m4-s1", {11: 5.2, 12: 5.1}) == [(11, CONTINUE), (12, CONTINUE)]
    assert not (tmp_path / STATE_DIR / ASHA_FILE).exists()  # no rung reached: nothing written


RUNS = {"bf16-s1": {10: 5.0, 30: 4.0}, "e4m3-s1": {11: 4.6, 30: 4.7, 40: 4.5}, "e3m4-s1": {10: 5.3, 31: 4.1},
        "e7m0-s1": {10: 5.9, 30: 5.0}, "bf16-s2": {10: 5.1, 30: 4.2}, "e4m3-s2": {10: 5.2, 30: 4.9}}


def stops_in_order(path, order: list[str], by_step: bool) -> dict:
    """The stops when the trials of RUNS report in `order`: step by step (all trials at a step,
    then the next step), or one trial to its end (completed) before the next starts."""
    s = rungs(StateStore(str(path)))
    if by_step:
        for step in sorted({step for losses in RUNS.values() for step in losses}):
            for trial in order:
                if step in RUNS[trial]:
                    feed(s, trial, {step: RUNS[trial][step]})
    else:
        for trial in order:
            feed(s, trial, RUNS[trial])
            last = max(RUNS[trial])
            s.on_trial_complete(None, SimpleNamespace(trial_id=trial, config={"key": trial}),
                                {"step": last, "val/loss": RUNS[trial][last]})
    state = json.loads((path / STATE_DIR / ASHA_FILE).read_text())
    return {t: (d["step"], d["rung"], d["value"], d["reference"]) for t, d in state["stopped"].items()}


def test_which_trials_stop_and_where_does_not_depend_on_which_ran_ahead(tmp_path):
    """The same values, reported in four orders: bf16 first or last, step by step or each trial
    run to its end before the next (then a format finishes before its bf16 reaches any rung).
    The same trials stop at the same steps, rungs and references."""
    orders = [(sorted(runs := list(RUNS)), True), (sorted(runs, reverse=True), True),
              (sorted(runs), False), (sorted(runs, reverse=True), False)]
    got = [stops_in_order(tmp_path / str(i), order, by_step) for i, (order, by_step) in enumerate(orders)]
    assert got[0] == {"e7m0-s1": (10, 10, 5.9, 5.0), "e4m3-s1": (30, 30, 4.7, 4.0), "e4m3-s2": (30, 30, 4.9, 4.2)}
    assert all(g == got[0] for g in got[1:])


def test_a_stop_shows_the_digits_that_tell_behind_from_tolerance():
    stop = {"reason": "asha", "step": 10, "value": 9.9133, "reference": 9.8907, "reference_key": None,
            "behind": (9.9133 - 9.8907) / 9.8907, "tolerance": 0.001}
    assert "0.23 % behind the rung's best" in stop_detail(stop) and "tolerance 0.10 %" in stop_detail(stop)
    assert "10.004 % behind" in stop_detail({**stop, "behind": 0.10004, "tolerance": 0.1})
    assert "asha: 125 % behind" in stop_detail({**stop, "behind": 1.25, "tolerance": 0.1})  # not 1.2e+02


def test_a_bf16_reference_is_stopped_only_when_broken(tmp_path):
    """bf16 is what every format of its seed is divided by: far behind another seed's trial (seeds
    see other batches) it runs its full budget; NaN still stops it."""
    s = rungs(StateStore(str(tmp_path)), tolerance=0.001)
    feed(s, "e4m3-s1", {10: 9.89})
    assert feed(s, "bf16-s2", {10: 9.91, 30: 9.0})[-1] == (30, CONTINUE)  # 0.2 % behind e4m3-s1
    assert feed(s, "bf16-s1", {10: 12.0})[-1] == (10, CONTINUE)  # 21 % behind
    assert feed(s, "bf16-s1", {30: math.nan})[-1] == (30, STOP)
    assert feed(s, "e5m2-s1", {10: 12.5})[-1] == (10, STOP)  # a format is still judged: 4 % behind bf16-s1
    state = json.loads((tmp_path / STATE_DIR / ASHA_FILE).read_text())
    assert set(state["stopped"]) == {"bf16-s1", "e5m2-s1"} and state["stopped"]["bf16-s1"]["reason"] == "nan"


def test_restored_rungs_decide_like_the_original(tmp_path):
    """A restore (new scheduler object, state from asha.json) makes the same decisions, and a
    trial replaying from an older checkpoint is stopped again at the step it was stopped at."""
    a, b = StateStore(str(tmp_path / "a")), StateStore(str(tmp_path / "b"))
    runs = {"bf16-s1": {10: 5.0, 30: 4.0}, "e7m0-s1": {10: 6.0, 20: 5.5}, "e4m3-s1": {10: 5.1, 30: 4.1},
            "e5m2-s1": {10: 5.2, 30: 4.9, 40: 4.5}, "nan-s1": {10: 5.0, 30: math.inf}}
    unbroken = rungs(a)
    expected = {t: feed(unbroken, t, losses) for t, losses in runs.items()}
    assert expected["e7m0-s1"][0] == (10, STOP) and expected["e5m2-s1"][1] == (30, STOP)

    before = rungs(b)
    feed(before, "bf16-s1", runs["bf16-s1"])
    feed(before, "e7m0-s1", runs["e7m0-s1"])
    restored = pickle_roundtrip(before)  # what Tuner.restore does with tuner.pkl
    assert restored._state is None
    assert feed(restored, "e7m0-s1", {5: 7.0, 10: 6.0}) == [(5, CONTINUE), (10, STOP)]  # the replay
    got = {t: feed(restored, t, runs[t]) for t in ("e4m3-s1", "e5m2-s1", "nan-s1")}
    assert got == {t: expected[t] for t in ("e4m3-s1", "e5m2-s1", "nan-s1")}
    assert json.loads((tmp_path / "b" / STATE_DIR / ASHA_FILE).read_text()) == \
        json.loads((tmp_path / "a" / STATE_DIR / ASHA_FILE).read_text())


def test_a_skipped_nan_step_on_a_rung_does_not_stop_a_trial_its_stability_policy_keeps(tmp_path):
    """The trainer skips a step whose loss is NaN and stops a run only after `nan_patience` of them
    in a row. One such step on a rung's step, the val loss finite, is not a broken trial there:
    ASHA sees the val loss (it saw +inf and stopped the run as `nan`). A non-finite evaluation is."""
    from altgrad.config import StabilityConfig
    from altgrad.metrics import LOSS_IS_NAN, NAN_STREAK, STABLE_LR, STEP, VAL_LOSS, VAL_STEP
    from altgrad.tune.trainable import SweepSignals

    s = rungs(StateStore(str(tmp_path)))
    feed(s, "bf16-s1", {10: 5.0})
    skipped = {STEP: 10, VAL_LOSS: 5.05, VAL_STEP: 10, LOSS_IS_NAN: 1.0, NAN_STREAK: 1.0}
    signals = SweepSignals(StabilityConfig(nan_patience=5), 1e-3).observe(skipped)
    assert feed(s, "e4m3-s1", {10: signals[VAL_LOSS]}) == [(10, CONTINUE)]
    assert signals[STABLE_LR] == 0.0  # (the learning-rate search still counts it against the rate)
    collapsed = SweepSignals(StabilityConfig(nan_patience=5), 1e-3).observe({**skipped, VAL_LOSS: math.nan})
    assert feed(s, "e5m2-s1", {10: collapsed[VAL_LOSS]}) == [(10, STOP)]
