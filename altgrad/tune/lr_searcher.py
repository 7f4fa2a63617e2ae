"""The learning-rate search's searcher: the configured grid first, then TPE samples modelled on it.

Ray's `OptunaSearch` puts `points_to_evaluate` in the Optuna study ahead of any sample, but on its
own it does not search: TPE samples at random until 10 trials have finished (its default
`n_startup_trials`, more than a format's 5 grid points and 3 samples), trials running in parallel
do not count as finished, and one seed gave every format the same random samples. Here:

- a sample is asked for only once every grid point has finished (`suggest` answers None, "not yet",
  and Tune asks again after its next trial event): one asked while grid points still run would be
  drawn at random;
- each sample is drawn between the largest learning rate that trained stably so far and the
  smallest above it that did not (`edge_bracket`), where a sample can raise the answer: over the
  whole range, TPE spent most of its few samples at the range's far ends (docs/design.md);
- so the grid is all the start-up TPE needs: it models from its first finished trial on
  (`n_startup_trials=1`). Optuna counts only completed trials there, so with the grid's size a
  grid point that errored left every sample random; and an errored trial stands in for one that
  did not train stably in what TPE models (`modelled_trials`);
- without the constant liar (Optuna's default): the samples are asked for together once the grid
  has finished, and the liar would count those still running as failures, pushing the later ones
  away from the edge the first one found, out to rates the grid already judged;
- each format's sampler has its own seed (`LrSearch` derives it from the sweep's seed and the
  format), the same in every run of the sweep;
- Optuna is told each trial's final result only. Intermediate values feed only a pruner, and Ray
  runs Optuna without one (a stability verdict needs the whole run). A resumed trial reports steps
  Optuna already has: its checkpoint's row again (`TuneReporter`, for ASHA), and from Tune's
  `training_iteration` 1 again where no Tune checkpoint carried the count (local storage), which
  Optuna ignores with a warning;
- a resumed sweep runs its errored trials again under their trial ids (`resume_errored`,
  `altgrad.tune.runner`), and each rerun's result reaches Optuna as a first run's would: the
  errored run was never told to Optuna (a told trial cannot be told again), and `restore` takes it
  back among the running trials, so samples wait for a grid point's rerun as for its first run.
  For the same reason `max_concurrent_trials` is kept here (`set_max_concurrency`).

The trial sets below are part of the searcher's state, which Tune saves with the experiment's and
restores on resume; the trials asked so far, in order, are Optuna's (`OptunaSearch._ot_trials`).
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import FloatDistribution
from optuna.samplers import TPESampler
from optuna.trial import FrozenTrial, TrialState, create_trial
from ray.tune.search.optuna import OptunaSearch

from altgrad.metrics import STABLE_LR


class GridThenTpe(OptunaSearch):
    """Learning rates: `grid` in order, then TPE's samples (maximizing `sweep/stable_lr`)."""

    # no limit of its own unless Tune passes `max_concurrent_trials` (`set_max_concurrency`); a class
    # default, as a searcher pickled before it had one (a sweep resumed across versions) has none
    max_concurrent = 0
    # A sweep started before errored trials were kept open (2026-12-02) keeps that version's way:
    # Tune restores its limiter's saved state, which limits again and drops the completions of
    # trials it no longer holds, so a rerun reopened here would never finish and the samples would
    # wait for it for good. There an errored trial is told to Optuna as unstable, as it was.
    tells_errors = False

    def __init__(self, grid: list[float], seed: int) -> None:
        # Optuna's INFO lines ("A new study created in memory") interleave with the sweep's own
        # progress lines, which say what each trial did; its warnings still show.
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        super().__init__(metric=STABLE_LR, mode="max", points_to_evaluate=[{"lr": lr} for lr in grid],
                         sampler=TPESampler(n_startup_trials=1, seed=seed, constant_liar=False))
        self.grid_size = len(grid)
        self.finished: set[str] = set()
        self.errored: set[str] = set()  # finished, by an error, in this run of the sweep

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        asked = list(self._ot_trials)  # trial ids in the order they got their learning rate, the grid's first
        if self.max_concurrent and len(asked) - len(self.finished) >= self.max_concurrent:
            return None
        if len(asked) >= self.grid_size:
            if not self.finished.issuperset(asked[:self.grid_size]):
                return None
            self._ot_study.enqueue_trial(self.sample())
        return super().suggest(trial_id)

    def sample(self) -> dict[str, Any]:
        """TPE's next learning rate, drawn in a study of `modelled_trials` (Optuna's own study
        keeps an errored trial open for its rerun) inside their `edge_bracket`; Optuna's study gets
        it as an enqueued point."""
        trials = self.modelled_trials()
        view = optuna.create_study(direction="maximize", sampler=self._sampler)  # Optuna's study's
        view.add_trials(trials)
        return view.ask({**self._space, "lr": edge_bracket(trials, self._space["lr"])}).params

    def modelled_trials(self) -> list[FrozenTrial]:
        """What TPE's samples model: the trials Optuna was told of, then each errored one as a trial
        that did not train stably (`sweep/stable_lr` 0): as a failed trial TPE left it out of its
        model, and its samples strayed to rates below the whole grid (1e-4 with the grid's 1e-3
        errored)."""
        told = self._ot_study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        errored = [trial for t, trial in self._ot_trials.items() if t in self.errored]
        return [*told, *(create_trial(params=t.params, distributions=t.distributions, value=0.0) for t in errored)]

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        """Nothing: Optuna judges a trial by its final result (see the module's docstring)."""

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        """An errored trial is not told to Optuna: it counts as unstable in `modelled_trials` until
        a resumed sweep runs it again (`restore`)."""
        self.finished.add(trial_id)
        if error and self.tells_errors:
            super().on_trial_complete(trial_id, {STABLE_LR: 0.0})
        elif error:
            self.errored.add(trial_id)
        else:
            super().on_trial_complete(trial_id, result)

    def restore(self, checkpoint_path: str) -> None:
        """Tune restores a searcher to resume its sweep, which runs every errored trial again
        (`resume_errored`): each is running again, as before it errored."""
        super().restore(checkpoint_path)
        if "errored" not in vars(self):  # saved by the version before (`tells_errors`)
            self.tells_errors = True
        self.finished -= getattr(self, "errored", set())
        self.errored = set()

    def set_max_concurrency(self, max_concurrent: int) -> bool:
        """Tune's `ConcurrencyLimiter` (`max_concurrent_trials`) leaves the limit to this searcher:
        the limiter passes on only the completions of trials it holds as running, and an errored
        trial left them, so it dropped its rerun's result."""
        self.max_concurrent = max_concurrent
        return True


def edge_bracket(trials: list[FrozenTrial], space: FloatDistribution) -> FloatDistribution:
    """The learning rates where a sample can raise the largest stable one: from the largest that
    trained stably (`sweep/stable_lr` > 0) to the smallest above it that did not, within `space`
    (its bound on a side where no trial is)."""
    stable = [t.params["lr"] for t in trials if (t.value or 0.0) > 0]
    low = min(max(max(stable, default=space.low), space.low), space.high)
    above = [t.params["lr"] for t in trials if (t.value or 0.0) <= 0 and t.params["lr"] > low]
    return FloatDistribution(low, min(min(above, default=space.high), space.high), log=space.log)
