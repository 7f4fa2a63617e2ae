"""One line per trial event on the driver's console, instead of Ray's per-trial tables.

Ray's own reporter prints every trial's config and a hundred-row result table; for a grid of dozens
of trials the line that matters is which trial ended, how and where.
"""

from __future__ import annotations

import math
import time
from typing import Any

from ray.tune import Callback

from altgrad.experiment import (
    ASHA_FILE,
    STOPPER_FILE,
    TERMINAL_STATUSES,
    StopReason,
    TrialStatus,
    stop_detail,
)
from altgrad.metrics import NAN_STREAK, STEP, VAL_LOSS
from altgrad.tune.store import StateStore
from altgrad.tune.trial_spec import trial_key


class SweepProgress(Callback):
    def __init__(self, store: StateStore, total: int):
        self._store = store
        self._total = total
        self._started: dict[str, float] = {}

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        self._started[trial.trial_id] = time.monotonic()

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        result: dict[str, Any] = trial.last_result or {}
        val = result.get(VAL_LOSS, math.nan)
        self._line(trials, trial, True, f"{self._reason(trial.trial_id, result)}; last report "
                   f"step {int(result.get(STEP, 0))}, val loss {val:.4f}{self._took(trial.trial_id)}")

    def on_trial_recover(self, iteration: int, trials: list, trial, **info) -> None:
        self._line(trials, trial, False, "failed, retrying from its checkpoint")

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self._line(trials, trial, True, "ERROR after its retries (see `python -m altgrad trials`)")

    def _reason(self, trial_id: str, result: dict[str, Any]) -> str:
        for name in (STOPPER_FILE, ASHA_FILE):
            stopped = (self._store.read(name) or {}).get("stopped", {}).get(trial_id)
            if stopped is not None:
                return stop_detail({"reason": StopReason.ASHA, **stopped})
        return StopReason.NAN if result.get(NAN_STREAK, 0) > 0 else StopReason.COMPLETED

    def _took(self, trial_id: str) -> str:
        start = self._started.pop(trial_id, None)
        return f" ({time.monotonic() - start:.0f} s)" if start is not None else ""

    def _line(self, trials: list, trial, ended: bool, text: str) -> None:
        """`[done/total done, n running] key: text`, counting `trial` as it will be."""
        others = [t for t in trials if t is not trial]
        done = sum(t.status in TERMINAL_STATUSES for t in others) + ended
        running = sum(t.status == TrialStatus.RUNNING for t in others)
        print(f"[{done:>{len(str(self._total))}}/{self._total} done, {running} running] "
              f"{trial_key(trial.config)}: {text}", flush=True)
