"""ASHA whose rung state lives in the experiment dir, so a restored sweep decides as the original.

Ray's `AsyncHyperBandScheduler` keeps its rungs in memory and `Tuner.restore` starts it empty: a
resumed sweep would judge later trials against nothing and let through what the original run cut.
This is asynchronous successive halving with one bracket (no random bracket choice): a trial is
recorded at a rung when it first reports a step at or past the rung's milestone, and stopped if
its value is worse than the 1/rf quantile of the values recorded there before it (Ray's rule).
Non-finite values count as the worst possible, so NaN trials are cut. Each record and stop is
written to `asha.json` before the decision takes effect and is read back on restore; a trial
resumed from a checkpoint older than its stop is stopped again at the same step, so what it
re-trains up to the stop is identical.
"""

from __future__ import annotations

import math
from typing import Any

from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from altgrad.experiment import ASHA_FILE
from altgrad.tune.store import StateStore


def asha_milestones(grace_period: int, reduction_factor: float, max_t: int) -> list[int]:
    """The rungs: grace_period × rf^k below max_t (a rung at the last step could save nothing)."""
    rungs, t = [], float(grace_period)
    while t < max_t:
        rungs.append(int(round(t)))
        t *= reduction_factor
    return rungs


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile that stays +inf (never NaN) when +inf values are involved."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    if xs[lo] == xs[hi]:
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class PersistentASHA(FIFOScheduler):
    def __init__(self, store: StateStore, *, metric: str, mode: str, max_t: int, grace_period: int,
                 reduction_factor: float, time_attr: str = "step"):
        super().__init__()
        self._store = store
        self._metric = metric
        self._sign = 1.0 if mode == "min" else -1.0
        self._time_attr = time_attr
        self._rf = reduction_factor
        self.milestones = asha_milestones(grace_period, reduction_factor, max_t)
        self._state: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Ray pickles the scheduler into tuner.pkl; the rung state must come from asha.json.
        return {**self.__dict__, "_state": None}

    @property
    def state(self) -> dict[str, Any]:
        """{"milestones", "rungs": {milestone: {trial_id: value}}, "stopped": {trial_id: {...}}}."""
        if self._state is None:
            self._state = self._store.read(ASHA_FILE) or {
                "milestones": self.milestones,
                "rungs": {str(m): {} for m in self.milestones},
                "stopped": {},
            }
        return self._state

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        return self._observe(trial.trial_id, result)

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        self._observe(trial.trial_id, result)  # a final result may still reach a rung, as in Ray

    def _observe(self, trial_id: str, result: dict) -> str:
        if self._time_attr not in result or self._metric not in result:
            return TrialScheduler.CONTINUE
        t = result[self._time_attr]
        stopped = self.state["stopped"].get(trial_id)
        if stopped is not None:  # decided before (a resumed trial replaying its way to the stop)
            return TrialScheduler.STOP if t >= stopped["step"] else TrialScheduler.CONTINUE
        reached = [m for m in self.milestones if m <= t]
        if not reached:
            return TrialScheduler.CONTINUE
        rung = self.state["rungs"][str(reached[-1])]
        if trial_id in rung:
            return TrialScheduler.CONTINUE
        value = result[self._metric]
        cutoff = quantile([self._score(v) for v in rung.values()], 1 / self._rf) if rung else None
        rung[trial_id] = value
        action = TrialScheduler.CONTINUE
        if cutoff is not None and self._score(value) > cutoff:
            action = TrialScheduler.STOP
            self.state["stopped"][trial_id] = {
                "step": int(t), "rung": reached[-1], "value": value, "cutoff": self._sign * cutoff,
            }
        self._store.write(ASHA_FILE, self.state)
        return action

    def _score(self, value: float) -> float:
        """Lower is better; anything non-finite is the worst."""
        score = self._sign * value
        return score if math.isfinite(score) else math.inf

    def debug_string(self) -> str:
        rungs = ", ".join(f"{m}: {len(self.state['rungs'][str(m)])} recorded" for m in self.milestones)
        return f"Persistent ASHA on {self._metric}: {rungs}; {len(self.state['stopped'])} stopped"
