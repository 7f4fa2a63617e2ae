"""The stability stopper: ends trials that broke numerically, and remembers why and when.

ASHA only compares losses; a trial that keeps producing NaN steps, or whose weights stopped moving
in their 8-bit format (bit-stall) for many reports in a row, is stopped here whatever its loss.
Each trial is judged by its own run config's `stability` thresholds (`nan_patience`,
`stall_stop_reports`; `stall_stop` sets what counts as stalled), the ones its trainer acts on.
The NaN streak comes from the trainer (`stability/nan_streak`); the stall streak from the trainable
(`sweep/stall_streak`), both rebuilt exactly on resume, so a restored sweep stops the same trials
at the same steps. Decisions go to `stopper.json` for the trial table (stop reason `nan` /
`bit_stall`), written before the stop takes effect.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.tune.stopper import Stopper

from altgrad.config import StabilityConfig
from altgrad.experiment import STOPPER_FILE, StopReason
from altgrad.metrics import NAN_STREAK, STALL_STREAK, STEP
from altgrad.tune.store import StateStore


def stability_stop(report: Mapping[str, Any], limits: StabilityConfig) -> dict[str, Any] | None:
    """The stop a trial's report calls for under its run's `limits`, with its numbers, or None. The
    stopper acts on it; the trainable reads it too, so that a report the stopper ends a trial on
    never calls the trial stable (`sweep/stable_lr`)."""
    if report.get(NAN_STREAK, 0) >= limits.nan_patience:
        return {"reason": StopReason.NAN, "streak": int(report[NAN_STREAK]), "patience": limits.nan_patience}
    if report.get(STALL_STREAK, 0) >= limits.stall_stop_reports:
        # the threshold is recorded with the stop; the streak is counted by the trainable
        return {"reason": StopReason.BIT_STALL, "streak": int(report[STALL_STREAK]),
                "patience": limits.stall_stop_reports, "threshold": limits.stall_stop}
    return None


class StabilityStopper(Stopper):
    def __init__(self, store: StateStore, stability: Mapping[str, StabilityConfig]):
        """`stability`: each grid point's thresholds (its run config's `stability`) by grid key,
        the `key` of a trial's config."""
        self._store = store
        self.stability = dict(stability)
        self._state: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_state": None}  # decisions come from stopper.json, not the pickle

    @property
    def state(self) -> dict[str, Any]:
        """{"stopped": {trial_id: {"reason": "nan" | "bit_stall", "step", "streak", "patience"}}}."""
        if self._state is None:
            self._state = self._store.read(STOPPER_FILE) or {"stopped": {}}
        return self._state

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        if STEP not in result:
            return False
        step = int(result[STEP])
        stopped = self.state["stopped"].get(trial_id)
        if stopped is not None:  # a resumed trial replaying its way to the recorded stop
            return step >= stopped[STEP]
        decision = stability_stop(result, self.stability[result["config"]["key"]])
        if decision is None:
            return False
        self.state["stopped"][trial_id] = {**decision, STEP: step}
        self._store.write(STOPPER_FILE, self.state)
        return True

    def stop_all(self) -> bool:
        return False
