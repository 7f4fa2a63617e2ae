"""Early stopping tied to stability, at ASHA's rungs, with its state in the experiment dir.

This is an ablation: every healthy format must be measured over the full budget, so a rung does not
keep "the best third" (Ray's ASHA rule, a hyper-parameter-search tool's). A trial is stopped at a
rung only when it is broken: its value is non-finite (reason `nan`), or it trails the rung's
reference by more than `tolerance` (reason `asha`). The reference is the bf16 trial of the same
optimizer, seed and extra-axis values; a trial that reaches a rung before its bf16 does waits for
it (`pending`) and is judged when bf16's value is recorded there, at the step at which it reached
the rung (a running trial stops at its next report; the readers cut a finished one's record at
that step), so which trials stop, and where, never depends on which trial ran ahead. Only a trial
without a bf16 reference in the grid is judged against the best value recorded at the rung so far.
A bf16 trial that is another trial's reference stops only when non-finite: every ratio to bf16
divides by its loss, which a run cut short would make a run of fewer steps. A trial is recorded at
a rung when it first reports a step at or past the rung's milestone. The NaN-streak and bit-stall rules live in `stopper.StabilityStopper`.

Ray's `AsyncHyperBandScheduler` keeps its rungs in memory and `Tuner.restore` starts it empty;
here each record and stop is written to `asha.json` before the decision takes effect and read back
on restore, so a resumed sweep decides as the original. A trial resumed from a checkpoint older
than its stop is stopped again at the same step, so what it re-trains up to the stop is identical.
"""

from __future__ import annotations

import math
from typing import Any

from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from altgrad.experiment import ASHA_FILE, StopReason
from altgrad.metrics import STEP
from altgrad.tune.config import asha_milestones
from altgrad.tune.store import StateStore
from altgrad.tune.trial_spec import trial_key

PENDING = object()  # `_judge`: the trial's bf16 reference has not reached the rung yet


class StabilityRungs(FIFOScheduler):
    """See the module docstring. `references` maps a trial key to its bf16 reference's key."""

    def __init__(self, store: StateStore, *, metric: str, mode: str, max_t: int, grace_period: int,
                 reduction_factor: float, tolerance: float, references: dict[str, str | None],
                 time_attr: str = STEP):
        super().__init__()
        self._store = store
        self._metric = metric
        self._sign = 1.0 if mode == "min" else -1.0
        self._time_attr = time_attr
        self.tolerance = tolerance
        self.references = references
        self._baselines = {ref for ref in references.values() if ref is not None}
        self.milestones = asha_milestones(grace_period, reduction_factor, max_t)
        self._state: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Ray pickles the scheduler into tuner.pkl; the rung state must come from asha.json.
        return {**self.__dict__, "_state": None}

    @property
    def state(self) -> dict[str, Any]:
        """{"milestones", "rungs": {milestone: {trial_id: value}}, "keys": {trial_id: key},
        "pending": {trial_id: [[milestone, step it reached it], ...] waiting for bf16 there},
        "stopped": {trial_id: {"reason", "step", "rung", "value", "reference", "behind", ...}}}."""
        if self._state is None:
            self._state = self._store.read(ASHA_FILE) or {
                "milestones": self.milestones,
                "rungs": {str(m): {} for m in self.milestones},
                "keys": {},
                "stopped": {},
            }
            self._state.setdefault("pending", {})  # (an asha.json from before it was kept)
        return self._state

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        return self._observe(trial.trial_id, trial_key(trial.config), result)

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        self._observe(trial.trial_id, trial_key(trial.config), result)  # a final result may reach a rung

    def _observe(self, trial_id: str, key: str, result: dict) -> str:
        if self._time_attr not in result or self._metric not in result:
            return TrialScheduler.CONTINUE
        t = int(result[self._time_attr])
        stopped = self.state["stopped"].get(trial_id)
        if stopped is not None:  # decided before: at a rung, or while waiting for bf16 there
            return TrialScheduler.STOP if t >= stopped[STEP] else TrialScheduler.CONTINUE
        reached = [m for m in self.milestones if m <= t]
        if not reached or trial_id in self.state["rungs"][str(reached[-1])]:
            return TrialScheduler.CONTINUE
        m, value = reached[-1], result[self._metric]
        rung = self.state["rungs"][str(m)]
        rung[trial_id] = value
        self.state["keys"][trial_id] = key
        verdict = self._judge(trial_id, key, value, rung)
        if verdict is PENDING:
            self.state["pending"].setdefault(trial_id, []).append([m, t])
        elif verdict is not None:
            self._stop(trial_id, m, t, verdict)
        if key in self._baselines:
            self._judge_waiting(key, m)
        self._store.write(ASHA_FILE, self.state)
        return TrialScheduler.STOP if trial_id in self.state["stopped"] else TrialScheduler.CONTINUE

    def _judge_waiting(self, reference_key: str, m: int) -> None:
        """Judge the trials that reached rung m before their bf16 (`reference_key`) did, each at the
        step it reached the rung: a running one stops at its next report, one already finished is
        cut there by the readers (`experiment.load_experiment`)."""
        keys, rung = self.state["keys"], self.state["rungs"][str(m)]
        for trial_id, waits in list(self.state["pending"].items()):
            if self.references.get(keys[trial_id]) != reference_key:
                continue
            for rung_m, step in [w for w in waits if w[0] == m]:
                waits.remove([rung_m, step])
                verdict = self._judge(trial_id, keys[trial_id], rung[trial_id], rung)  # (bf16 is there now)
                if verdict is not None:
                    self._stop(trial_id, m, step, verdict)
            if not waits:
                self.state["pending"].pop(trial_id, None)

    def _stop(self, trial_id: str, m: int, step: int, verdict: dict[str, Any]) -> None:
        """Record that the trial is stopped at `step`, where it reached rung m (a stopped trial
        waits for no other rung)."""
        value = self.state["rungs"][str(m)][trial_id]
        self.state["stopped"][trial_id] = {STEP: step, "rung": m, "value": value, "tolerance": self.tolerance,
                                           **verdict}
        self.state["pending"].pop(trial_id, None)

    def _judge(self, trial_id: str, key: str, value: float, rung: dict[str, float]) -> dict[str, Any] | object | None:
        """None for a healthy trial, PENDING while its bf16 reference has no value at the rung yet,
        else why it is broken (reason and the numbers)."""
        if not math.isfinite(value):
            return {"reason": StopReason.NAN, "reference": None, "reference_key": None, "behind": None}
        if key in self._baselines:
            return None
        ref_key = self.references.get(key)
        keys = self.state["keys"]
        if ref_key is not None:
            bf16 = [v for tid, v in rung.items() if keys.get(tid) == ref_key]
            if not bf16:
                return PENDING
            if not math.isfinite(bf16[0]):  # a broken reference judges nothing
                return None
            reference, ref_name = bf16[0], ref_key
        else:
            scores = [self._sign * v for tid, v in rung.items() if tid != trial_id and math.isfinite(v)]
            if not scores:
                return None
            reference, ref_name = self._sign * min(scores), None
        behind = self._sign * (value - reference) / abs(reference) if reference else 0.0
        if behind <= self.tolerance:
            return None
        return {"reason": StopReason.ASHA, "reference": reference, "reference_key": ref_name, "behind": behind}

    def debug_string(self) -> str:
        rungs = ", ".join(f"{m}: {len(self.state['rungs'][str(m)])} recorded" for m in self.milestones)
        return (f"stability rungs on {self._metric} (tolerance {self.tolerance:g}): {rungs}; "
                f"{len(self.state['stopped'])} stopped")

