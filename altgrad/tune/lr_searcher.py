"""The learning-rate search's searcher: the configured grid first, then TPE samples modelled on it.

Ray's `OptunaSearch` puts `points_to_evaluate` in the Optuna study ahead of any sample, but on its
own it does not search: TPE samples at random until 10 trials have finished (its default
`n_startup_trials`, more than a format's 5 grid points and 3 samples), trials running in parallel
do not count as finished, and one seed gave every format the same random samples. Here:

- a sample is asked for only once every grid point has finished (`suggest` answers None, "not yet",
  and Tune asks again after its next trial event): one asked while grid points still run would be
  drawn at random;
- so the grid is all the start-up TPE needs: it models from its first finished trial on
  (`n_startup_trials=1`). Optuna counts only completed trials there, so with the grid's size a
  grid point that errored left every sample random; and an errored trial is told to it as one that
  did not train stably;
- without the constant liar (Optuna's default): the samples are asked for together once the grid
  has finished, and the liar would count those still running as failures, pushing the later ones
  away from the edge the first one found, out to rates the grid already judged;
- each format's sampler has its own seed (`LrSearch` derives it from the sweep's seed and the
  format), the same in every run of the sweep;
- Optuna is told each trial's final result only. Intermediate values feed only a pruner, and Ray
  runs Optuna without one (a stability verdict needs the whole run). A resumed trial reports steps
  Optuna already has: its checkpoint's row again (`TuneReporter`, for ASHA), and from Tune's
  `training_iteration` 1 again where no Tune checkpoint carried the count (local storage), which
  Optuna ignores with a warning.

The counters below are part of the searcher's state, which Tune saves with the experiment's and
restores on resume.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.samplers import TPESampler
from ray.tune.search.optuna import OptunaSearch

from altgrad.metrics import STABLE_LR


class GridThenTpe(OptunaSearch):
    """Learning rates: `grid` in order, then TPE's samples (maximizing `sweep/stable_lr`)."""

    def __init__(self, grid: list[float], seed: int) -> None:
        # Optuna's INFO lines ("A new study created in memory") interleave with the sweep's own
        # progress lines, which say what each trial did; its warnings still show.
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        super().__init__(metric=STABLE_LR, mode="max", points_to_evaluate=[{"lr": lr} for lr in grid],
                         sampler=TPESampler(n_startup_trials=1, seed=seed, constant_liar=False))
        self.grid_size = len(grid)
        self.asked = 0
        self.finished: set[str] = set()

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if self.asked >= self.grid_size and len(self.finished) < self.grid_size:
            return None
        self.asked += 1
        return super().suggest(trial_id)

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        """Nothing: Optuna judges a trial by its final result (see the module's docstring)."""

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        """An errored trial is told to Optuna as one that did not train stably (`sweep/stable_lr`
        0): as a failed trial TPE left it out of its model, and its samples strayed to rates below
        the whole grid (1e-4 with the grid's 1e-3 errored)."""
        self.finished.add(trial_id)
        if error:
            result, error = {STABLE_LR: 0.0}, False
        super().on_trial_complete(trial_id, result, error)
