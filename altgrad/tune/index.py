"""The trial index: which Ray trial is which grid point, where its directory is, its status.

A Tune callback on the driver rewrites `trials.json` on every trial start, retry, completion and
error, so that `python -m altgrad trials` can show a sweep while it runs without asking Ray (whose
own experiment state is only snapshotted every few seconds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.tune import Callback

from altgrad.experiment import TRIALS_FILE, TrialStatus
from altgrad.tune.store import StateStore
from altgrad.tune.trial_spec import trial_labels


class TrialIndex(Callback):
    def __init__(self, store: StateStore, labels: dict[str, dict[str, Any]]):
        self._store = store
        self._labels = labels  # grid key -> format, optimizer, precision, seed
        self._state: dict[str, dict[str, Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_state": None}  # the index comes from trials.json, not the pickle

    @property
    def state(self) -> dict[str, dict[str, Any]]:
        """{trial_id: {key, format, optimizer, precision, seed, params, status, failures, error,
        dir (Ray's trial dir)}}."""
        if self._state is None:
            self._state = self._store.read(TRIALS_FILE) or {}
        return self._state

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        self._update(trial, TrialStatus.RUNNING)

    def on_trial_recover(self, iteration: int, trials: list, trial, **info) -> None:
        self._update(trial, TrialStatus.PENDING, failed=True)  # Ray retries it from its checkpoint

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        self._update(trial, TrialStatus.TERMINATED)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self._update(trial, TrialStatus.ERROR, error=_last_error_line(trial))

    def _update(self, trial, status: str, error: str | None = None, failed: bool = False) -> None:
        entry = self.state.setdefault(trial.trial_id, {
            **trial_labels(trial.config, self._labels[trial.config["key"]]), "failures": 0,
        })
        entry.update(status=status, error=error, failures=entry["failures"] + failed,
                     dir=trial.storage.trial_dir_name)  # Ray's; it changes if Ray re-creates the trial
        self._store.write(TRIALS_FILE, self.state)


def _last_error_line(trial) -> str:
    path = trial.error_file
    text = Path(path).read_text() if path and Path(path).is_file() else ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "the trial failed (no error file)"
