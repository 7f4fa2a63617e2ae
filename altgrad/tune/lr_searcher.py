"""The learning-rate search's searcher: the configured grid first, then samples that close in on
the edge of stability.

Ray's `OptunaSearch` puts `points_to_evaluate` in the Optuna study ahead of any sample; the samples
are enqueued in the same study, each chosen here (`next_rate`): the middle, on the log scale, of
the widest stretch of the edge's bracket (`edge_bracket`: from the largest learning rate that
trained stably to the smallest above it that did not) that no sample still running splits. On a
monotone edge that halves the bracket with each result, and samples asked together split it
evenly instead of bunching. Optuna's TPE did neither: over the whole range it put most samples at
the range's far ends, where none could raise the answer, and inside the bracket it stayed by the
stable side (docs/design.md, measured). Here:

- a sample is asked for only once every grid point has finished (`suggest` answers None, "not yet",
  and Tune asks again after its next trial event): the bracket is the grid's;
- samples run one at a time, each after the one before has finished, unless the sweep's
  `max_concurrent_trials` lets w run at once: then sample i waits for the samples before i - w + 1
  and goes by their results only, splitting the bracket with the w - 1 samples after them, finished
  or not. So the rates asked depend on the results, not on when they came: a resumed search (whose
  restored trials run again) asks what one never interrupted asks, where taking whichever results
  had come when a slot freed up did not (docs/design.md). One at a time also closes in best;
- once no rate is left that a sample could try inside the bracket (the range's top trained
  stably; or, nothing stable, the smallest rate that diverged lies at the range's bottom, or every
  rate up to its top ran without learning), the search is over: `suggest` answers FINISHED, which
  ends the experiment short of its allowed trials, and records the bracket in the experiment's
  `SEARCH_FILE` (so that the sweep reads it as finished, not interrupted). A sample there would
  only repeat a rate already tried. Tune keeps that answer: a resumed search reruns its errored
  trials but asks for no more samples, even where a rerun would reopen the bracket (the table
  says where the edge lies, for a search with more samples or another range);
- where no rate trained stably, the samples look between the largest rate that ran without
  learning and the smallest that diverged (`learning_window`): above a rate too small to learn,
  below one that blew up;
- an errored trial says nothing about stability: it is not told to Optuna and bounds no bracket,
  but no sample takes its rate (its rerun will tell, under its key);
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
Given the same results, a search asks for the same rates, in a resumed run too.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import optuna
from optuna.distributions import FloatDistribution
from optuna.trial import FrozenTrial, TrialState
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from altgrad.experiment import SEARCH_FILE
from altgrad.metrics import DIVERGED, STABLE_LR
from altgrad.tune.lr_search import learning_window, samples_at_once, stability_edge
from altgrad.tune.store import StateStore


class GridThenEdge(OptunaSearch):
    """Learning rates: `grid` in order, then `next_rate` in the edge's bracket (Optuna's study keeps
    them all, maximizing `sweep/stable_lr`)."""

    # no limit of its own unless Tune passes `max_concurrent_trials` (`set_max_concurrency`); a class
    # default, as a searcher pickled before it had one (a sweep resumed across versions) has none
    max_concurrent = 0
    # A sweep started before errored trials were kept open (2026-12-02) keeps that version's way:
    # Tune restores its limiter's saved state, which limits again and drops the completions of
    # trials it no longer holds, so a rerun reopened here would never finish and the samples would
    # wait for it for good. There an errored trial is told to Optuna as unstable, as it was.
    tells_errors = False
    # where `suggest` records that the search is over (`SEARCH_FILE`); a searcher pickled before it
    # had one records nothing, and its sweep ends as it did then
    store: StateStore | None = None

    def __init__(self, grid: list[float], store: StateStore | None = None) -> None:
        # Optuna's INFO lines ("A new study created in memory") interleave with the sweep's own
        # progress lines, which say what each trial did; its warnings still show.
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        super().__init__(metric=STABLE_LR, mode="max", points_to_evaluate=[{"lr": lr} for lr in grid])
        self.grid_size = len(grid)
        self.finished: set[str] = set()
        self.errored: set[str] = set()  # finished, by an error, in this run of the sweep
        self.store = store

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        asked = list(self._ot_trials)  # trial ids in the order they got their learning rate, the grid's first
        if self.max_concurrent and len(asked) - len(self.finished) >= self.max_concurrent:
            return None
        if len(asked) >= self.grid_size:
            # sample i goes by the results of the grid and of the samples before i - window + 1,
            # which it waits for, and splits the stretches of the window's later ones
            window = samples_at_once(self.max_concurrent)
            known = asked[:self.grid_size + max(0, len(asked) - self.grid_size - window + 1)]
            if not self.finished.issuperset(known):
                return None
            numbers = {self._ot_trials[trial].number for trial in known}
            bracket = edge_bracket([t for t in self.told() if t.number in numbers], self._space["lr"])
            # (an errored trial bounds nothing, but a sample at its rate would share its key)
            taken = [*asked[len(known):], *(trial for trial in known if trial in self.errored)]
            rate = next_rate(bracket, [self._ot_trials[trial].params["lr"] for trial in taken])
            if rate is None:
                if self.store is not None:
                    self.store.write(SEARCH_FILE, {"bracket": list(bracket), "trials": len(asked)})
                return Searcher.FINISHED
            self._ot_study.enqueue_trial({"lr": rate})  # Optuna's study gets it as an enqueued point
        return super().suggest(trial_id)

    def told(self) -> list[FrozenTrial]:
        """The trials Optuna was told of, in order: not an errored one (until its rerun ends)."""
        return self._ot_study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        """Nothing: Optuna judges a trial by its final result (see the module's docstring)."""

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        """An errored trial is not told to Optuna (until a resumed sweep runs it again, `restore`)."""
        self.finished.add(trial_id)
        if error and self.tells_errors:
            super().on_trial_complete(trial_id, {STABLE_LR: 0.0})
        elif error:
            self.errored.add(trial_id)
        else:
            if result is not None and trial_id not in self._completed_trials:  # (what `edge_bracket` reads)
                self._ot_trials[trial_id].set_user_attr(DIVERGED, bool(result.get(DIVERGED, 1.0)))
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


# The name searchers pickled before 2026-12-03 (an lr search's tuner.pkl) are read back under.
GridThenTpe = GridThenEdge


def edge_bracket(trials: list[FrozenTrial], space: FloatDistribution) -> tuple[float, float]:
    """The learning rates where a sample can raise the largest stable one: the `stability_edge` of
    the trials Optuna was told of (stable: `sweep/stable_lr` > 0), or where none was stable, the
    `learning_window` (diverged: the `sweep/diverged` their last report said, kept as a user
    attribute; a trial told without it counts as diverged, as all did before), within `space` (its
    bound on a side without one)."""
    low, high = stability_edge((t.params["lr"], (t.value or 0.0) > 0) for t in trials)
    if low is None:
        low, high = learning_window((t.params["lr"], t.user_attrs.get(DIVERGED, True)) for t in trials)
    low = min(max(space.low if low is None else low, space.low), space.high)
    return low, max(min(space.high if high is None else high, space.high), low)


def next_rate(bracket: tuple[float, float], running: list[float]) -> float | None:
    """The geometric middle of the widest stretch of `bracket` between the `running` rates inside
    it (the lowest of equal ones): one sample at a time, bisection; several at once, an even split
    of the bracket; rounded to 3 significant digits where that stays inside the stretch. None
    where no stretch has a rate inside it (a bracket of zero width: one of the range's bounds),
    where a sample could only repeat a rate tried, and whatever the running rates find can only
    narrow it."""
    low, high = bracket
    points = [low, *sorted(r for r in running if low < r < high), high]
    a, b = max(pairwise(points), key=lambda gap: math.log(gap[1] / gap[0]))
    middle = math.sqrt(a * b)
    # to 3 significant digits (a trial's key and directory name carry it: `lr0.316`, not
    # `lr0.31622776601683794`), more only where the stretch is too narrow for them
    return next((r for r in (float(f"{middle:.{d}e}") for d in range(2, 17)) if a < r < b), None)
