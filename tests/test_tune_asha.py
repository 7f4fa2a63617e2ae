"""The sweep's deciders without Ray running: persisted ASHA, the stability stopper, their signals."""

from __future__ import annotations

import json
import math
import signal
from types import SimpleNamespace

import pytest

from altgrad.config import build_run_config
from altgrad.experiment import ASHA_FILE, STATE_DIR, STOPPER_FILE, stop_detail
from altgrad.metrics import STABLE_LR, STALL_STREAK
from altgrad.tune.asha import StabilityRungs, asha_milestones
from altgrad.tune.config import SweepConfig
from altgrad.tune.runner import sigterm_stops_gracefully
from altgrad.tune.stopper import StabilityStopper
from altgrad.tune.store import StateStore
from altgrad.tune.trainable import SweepSignals, TuneReporter, stall_halts_learning

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


def test_the_reference_is_bf16_of_the_same_seed_else_the_rungs_best(tmp_path):
    s = rungs(StateStore(str(tmp_path)), tolerance=0.05)
    feed(s, "e4m3-s1", {10: 5.0})  # first at the rung: nothing to compare with
    assert feed(s, "e2m5-s1", {10: 5.2})[-1] == (10, CONTINUE)  # 4 % behind the rung's best
    assert feed(s, "e3m4-s1", {10: 5.3})[-1] == (10, STOP)  # 6 % behind it (bf16-s1 not there yet)
    feed(s, "bf16-s2", {10: 5.1})
    assert feed(s, "e4m3-s2", {10: 5.4})[-1] == (10, STOP)  # 5.9 % behind its own seed's bf16 ...
    assert feed(s, "bf16-s1", {10: 5.2})[-1] == (10, CONTINUE)  # bf16 itself: 4 % behind the best
    assert feed(s, "e5m2-s1", {10: 5.45})[-1] == (10, CONTINUE)  # ... 4.8 % behind bf16-s1, 9 % the best
    state = json.loads((tmp_path / STATE_DIR / ASHA_FILE).read_text())
    assert state["stopped"]["e3m4-s1"]["reference_key"] is None
    assert state["stopped"]["e3m4-s1"]["reference"] == 5.0


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


def pickle_roundtrip(obj):
    import pickle

    return pickle.loads(pickle.dumps(obj))


def test_stopper_stops_for_nan_and_bit_stall_and_replays(tmp_path):
    store = StateStore(str(tmp_path))
    stopper = StabilityStopper(store, nan_patience=3, stall_reports=4, stall_threshold=0.9)
    assert not stopper("n", {"step": 7, "stability/nan_streak": 2.0})
    assert stopper("n", {"step": 8, "stability/nan_streak": 3.0})
    assert not stopper("s", {"step": 5, STALL_STREAK: 3.0})
    assert stopper("s", {"step": 6, STALL_STREAK: 4.0})
    assert not stopper("ok", {"step": 6, STALL_STREAK: 0.0, "stability/nan_streak": 0.0})
    restored = pickle_roundtrip(stopper)
    assert not restored("n", {"step": 6, "stability/nan_streak": 0.0})  # replay before the stop
    assert restored("n", {"step": 8, "stability/nan_streak": 0.0})  # stopped again, same step
    state = json.loads((tmp_path / STATE_DIR / STOPPER_FILE).read_text())
    assert state["stopped"] == {
        "n": {"reason": "nan", "step": 8, "streak": 3, "patience": 3},
        "s": {"reason": "bit_stall", "step": 6, "streak": 4, "patience": 4, "threshold": 0.9}}
    assert stop_detail(state["stopped"]["s"]).startswith("bit_stall: bit-stall >= 0.9 for 4 reports")


def rows(n: int, stall: list[float]) -> list[dict[str, float]]:
    return [{"step": float(s), "train/loss": 5.0 - s / 10, "val/loss": 5.0 - (s // 5) / 2,
             "val/step": float(s // 5 * 5 or 1), "quant/bit_stall_rate": stall[s - 1]}
            for s in range(1, n + 1)]


def test_signals_after_resume_equal_an_unbroken_run(monkeypatch):
    """The stall streak and first val loss are rebuilt from the run's history on resume."""
    from altgrad.tune import trainable

    reported: list[dict] = []
    monkeypatch.setattr(trainable.tune, "report", lambda m, checkpoint=None: reported.append(m))
    history = rows(12, [0.999] * 3 + [0.5] + [0.999] * 8)
    unbroken = TuneReporter(SweepSignals(0.99, 1e-3), [], attach_checkpoints=False)
    for row in history:
        unbroken(row, None)
    expected = reported[:]
    reported.clear()
    resumed = TuneReporter(SweepSignals(0.99, 1e-3), history[:9], attach_checkpoints=False)  # as the kill left it
    for row in history[6:]:  # resumed from the checkpoint at step 6
        resumed(row, None)
    assert reported == expected[6:]
    assert expected[-1][STALL_STREAK] == 8.0
    assert expected[-1][STABLE_LR] == 1e-3



def test_a_trial_resumed_at_its_end_reports_its_last_row_once(monkeypatch):
    """Killed after its last step but before Tune recorded its end, a trial restarts, trains no
    step, and must still give the scheduler a result with its metrics."""
    from altgrad.tune import trainable

    reported: list[dict] = []
    monkeypatch.setattr(trainable.tune, "report", lambda m, checkpoint=None: reported.append(m))
    history = rows(12, [0.999] * 12)
    unbroken = TuneReporter(SweepSignals(0.99, 1e-3), [], attach_checkpoints=False)
    for row in history:
        unbroken(row, None)
    resumed = TuneReporter(SweepSignals(0.99, 1e-3), history, attach_checkpoints=False)
    resumed.report_if_silent()
    resumed.report_if_silent()  # once only
    assert reported[12:] == [reported[11]]
    trained = TuneReporter(SweepSignals(0.99, 1e-3), history[:6], attach_checkpoints=False)
    trained(history[6], None)
    trained.report_if_silent()  # it reported: nothing more
    assert len(reported) == 14


@pytest.mark.parametrize("attach", [True, False], ids=["remote", "local"])
def test_checkpoints_go_to_tune_only_on_remote_storage(monkeypatch, tmp_path, attach):
    """On local storage the run dir is the durable copy; a Tune checkpoint there could be rotated
    away before Tune saves its experiment state, and a restore from that state would then fail."""
    from altgrad.tune import trainable

    sent: list = []
    monkeypatch.setattr(trainable.tune, "report", lambda m, checkpoint=None: sent.append(checkpoint))
    reporter = TuneReporter(SweepSignals(0.99, 1e-3), [], attach_checkpoints=attach)
    (tmp_path / "step_000005").mkdir()
    for row, ckpt in zip(rows(6, [0.5] * 6), [None] * 4 + [tmp_path / "step_000005", None], strict=True):
        reporter(row, ckpt)
    assert [c is not None for c in sent] == [False] * 4 + [attach, False]
    if attach:
        assert sent[4].path == str(tmp_path / "step_000005")


def cpu_sweep(stall_reports: int) -> SweepConfig:
    """The cpu preset with diagnostics on every 5th step, as the cpu sweep runs it."""
    return SweepConfig.validated({
        "name": "t", "preset": "cpu", "resources": {"gpu_per_trial": 0, "cpus_per_trial": 1},
        "base": {"train": {"diag_every": 5}}, "grid": {"formats": ["e7m0"]},
        "stopper": {"stall_reports": stall_reports}})


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
    t = cfg.run_config({}).train
    assert (t.max_steps, t.diag_every, t.log_interval) == (60, 5, 1)
    stopper = StabilityStopper(StateStore(str(tmp_path)), nan_patience=5, stall_reports=stall_reports,
                               stall_threshold=cfg.stopper.stall_threshold)
    signals = SweepSignals(cfg.stopper.stall_threshold, 1e-3)
    stopped = next((int(row["step"]) for row in cpu_reports(t.max_steps, t.diag_every, stall_from)
                    if stopper("t1", {**row, **signals.observe(row)})), None)
    assert stopped == stop_step
    warning = cfg.stall_window_warning()
    assert (warning is None) == (stop_step is not None)
    if stop_step is None:
        assert "stopper.stall_reports (20)" in warning and "at most 13" in warning
    else:
        state = json.loads((tmp_path / STATE_DIR / STOPPER_FILE).read_text())
        assert state["stopped"]["t1"]["reason"] == "bit_stall"
        assert state["stopped"]["t1"]["step"] == stop_step

def test_signals_report_inf_for_broken_steps():
    s = SweepSignals(0.99, 1e-2)
    ok = s.observe({"step": 1.0, "val/loss": 5.0, "val/step": 1.0})
    assert ok["val/loss"] == 5.0 and ok[STABLE_LR] == 0.0  # not below its first evaluation yet
    nan = s.observe({"step": 2.0, "val/loss": 5.0, "val/step": 1.0, "stability/loss_is_nan": 1.0})
    assert nan["val/loss"] == math.inf and nan[STABLE_LR] == 0.0
    learning = s.observe({"step": 3.0, "val/loss": 4.0, "val/step": 3.0})
    assert learning[STABLE_LR] == 1e-2


def test_sigterm_takes_the_sigint_path():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda *a: seen.append("sigint"))
    try:
        with sigterm_stops_gracefully() as received:
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert received == [signal.SIGTERM] and seen == ["sigint"]


def test_bit_stall_stops_only_runs_whose_weights_live_in_the_format(tmp_path):
    """With fp32 master weights a stalled 8-bit view still learns: the same fully stalled stream
    that stops a format-stored run leaves an fp32-master run (and bf16) to ASHA's loss test."""
    decisions = {}
    for master in ("fp32", "format"):
        run = build_run_config({}, ["preset=cpu", "quant.format=e7m0", f"quant.master_weights={master}"])
        stopper = StabilityStopper(StateStore(str(tmp_path / master)), nan_patience=5, stall_reports=4,
                                   stall_threshold=0.99)
        signals = SweepSignals(0.99, 1e-3, stall_halts_learning(run))
        rows = ({"step": float(s), "val/loss": 5.0, "val/step": 1.0, "quant/bit_stall_rate": 1.0}
                for s in range(1, 21))
        decisions[master] = next((int(r["step"]) for r in rows if stopper("t", {**r, **signals.observe(r)})), None)
    assert decisions == {"fp32": None, "format": 4}
    assert not stall_halts_learning(build_run_config({}, ["preset=cpu", "quant.format=bf16"]))
