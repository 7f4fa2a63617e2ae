"""The sweep's deciders without Ray running: persisted ASHA, the stability stopper, their signals."""

from __future__ import annotations

import json
import math
import signal
from types import SimpleNamespace

import pytest

from altgrad.experiment import ASHA_FILE, STATE_DIR, STOPPER_FILE
from altgrad.tune.asha import PersistentASHA, asha_milestones, quantile
from altgrad.tune.config import SweepConfig
from altgrad.tune.runner import _sigterm_stops_gracefully
from altgrad.tune.stopper import StabilityStopper
from altgrad.tune.store import StateStore
from altgrad.tune.trainable import SweepSignals, TuneReporter
from altgrad.tune.trial_spec import STABLE_LR, STALL_STREAK

STOP, CONTINUE = "STOP", "CONTINUE"


def asha(store: StateStore) -> PersistentASHA:
    return PersistentASHA(store, metric="val/loss", mode="min", max_t=90, grace_period=10,
                          reduction_factor=3)


def feed(scheduler: PersistentASHA, trial: str, losses: dict[int, float]) -> list[tuple[int, str]]:
    """Report `losses` (step -> val loss) for one trial; the decisions, in order."""
    t = SimpleNamespace(trial_id=trial)
    return [(step, scheduler.on_trial_result(None, t, {"step": step, "val/loss": v}))
            for step, v in sorted(losses.items())]


def test_milestones_and_quantile():
    assert asha_milestones(10, 3, 90) == [10, 30]  # a rung at the last step could stop nothing
    assert asha_milestones(20, 3, 60) == [20]
    assert quantile([1.0, 2.0, 3.0], 1 / 3) == pytest.approx(1 + 2 / 3)  # Ray's rule
    assert quantile([1.0, math.inf, math.inf], 0.5) == math.inf  # never NaN


def test_asha_cuts_the_worse_trial_and_nan_trials(tmp_path):
    store = StateStore(str(tmp_path))
    s = asha(store)
    assert feed(s, "a", {5: 3.0, 10: 2.0, 20: 1.5}) == [(5, CONTINUE), (10, CONTINUE), (20, CONTINUE)]
    assert feed(s, "b", {10: 2.5})[-1] == (10, STOP)  # worse than the best third at rung 10
    assert feed(s, "c", {10: 1.0})[-1] == (10, CONTINUE)
    assert feed(s, "d", {10: math.nan})[-1] == (10, STOP)  # non-finite = worst, as +inf
    state = json.loads((tmp_path / STATE_DIR / ASHA_FILE).read_text())
    assert set(state["rungs"]["10"]) == {"a", "b", "c", "d"}
    assert state["stopped"]["b"] == {"step": 10, "rung": 10, "value": 2.5, "cutoff": 2.0}


def test_restored_asha_decides_like_the_original(tmp_path):
    """A restore (new scheduler object, state from asha.json) makes the same decisions, and a
    trial replaying from an older checkpoint is stopped again at the step it was stopped at."""
    a, b = StateStore(str(tmp_path / "a")), StateStore(str(tmp_path / "b"))
    runs = {"t1": {10: 2.0, 20: 1.9, 30: 1.5}, "t2": {10: 3.0, 20: 2.0}, "t3": {10: 1.0, 30: 0.9},
            "t4": {10: 1.5, 30: 2.0, 40: 1.0}}
    unbroken = asha(a)
    expected = {t: feed(unbroken, t, losses) for t, losses in runs.items()}

    before = asha(b)
    feed(before, "t1", runs["t1"])
    feed(before, "t2", runs["t2"])
    restored = pickle_roundtrip(before)  # what Tuner.restore does with tuner.pkl
    assert restored._state is None
    assert feed(restored, "t2", {5: 3.5, 10: 3.0}) == [(5, CONTINUE), (10, STOP)]  # the replay
    got = {t: feed(restored, t, runs[t]) for t in ("t3", "t4")}
    assert got == {t: expected[t] for t in ("t3", "t4")}
    assert json.loads((tmp_path / "b" / STATE_DIR / ASHA_FILE).read_text()) == \
        json.loads((tmp_path / "a" / STATE_DIR / ASHA_FILE).read_text())


def pickle_roundtrip(obj):
    import pickle

    return pickle.loads(pickle.dumps(obj))


def test_stopper_stops_for_nan_and_bit_stall_and_replays(tmp_path):
    store = StateStore(str(tmp_path))
    stopper = StabilityStopper(store, nan_patience=3, stall_reports=4)
    assert not stopper("n", {"step": 7, "stability/nan_streak": 2.0})
    assert stopper("n", {"step": 8, "stability/nan_streak": 3.0})
    assert not stopper("s", {"step": 5, STALL_STREAK: 3.0})
    assert stopper("s", {"step": 6, STALL_STREAK: 4.0})
    assert not stopper("ok", {"step": 6, STALL_STREAK: 0.0, "stability/nan_streak": 0.0})
    restored = pickle_roundtrip(stopper)
    assert not restored("n", {"step": 6, "stability/nan_streak": 0.0})  # replay before the stop
    assert restored("n", {"step": 8, "stability/nan_streak": 0.0})  # stopped again, same step
    state = json.loads((tmp_path / STATE_DIR / STOPPER_FILE).read_text())
    assert state["stopped"] == {"n": {"reason": "nan", "step": 8}, "s": {"reason": "bit_stall", "step": 6}}


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
    stopper = StabilityStopper(StateStore(str(tmp_path)), nan_patience=5, stall_reports=stall_reports)
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
        assert state["stopped"] == {"t1": {"reason": "bit_stall", "step": stop_step}}

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
        with _sigterm_stops_gracefully() as received:
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert received == [signal.SIGTERM] and seen == ["sigint"]
