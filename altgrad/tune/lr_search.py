"""The learning-rate search: per format, the largest learning rate that still trains stably.

One Tune experiment per format (`<experiment>/<format>/`), searched through Optuna over a
log-uniform range: the configured grid of learning rates is evaluated first (`points_to_evaluate`,
since `grid_search` cannot be mixed with a searcher), then `samples` more once the grid has
finished, each where it can raise the answer: between the largest rate that trained stably and the
smallest above it that did not (`lr_searcher`). Each trial reports `sweep/stable_lr` (its learning
rate while it learns stably, else 0), which Optuna's study maximizes.
No ASHA: a stability verdict needs the whole run; the stability stopper still ends NaN and bit-stall
runs early. A format whose trials would train bit for bit like an earlier format's (e1m6 like e0m7
under amax scaling: `grid.twin_of`) is not searched again: given the same results the searcher
asks for the same rates, so the two searches are one measurement (`searched_as`).
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from altgrad.experiment import LR_SEARCH_FILE, StopReason, TrialRecord, TrialStatus, load_experiment
from altgrad.metrics import LOSS_IS_NAN
from altgrad.remote import is_remote, join, split_name
from altgrad.run_model import assigned_formats
from altgrad.tune.config import LrSearchConfig
from altgrad.tune.grid import GridPoint, describe_resources, make_point, twin_of
from altgrad.tune.runner import Experiment
from altgrad.tune.store import StateStore
from altgrad.tune.trial_spec import RISE_MARGIN, trial_labels, trial_limits, verdict, worst


class LrSearch:
    kind = "lr_search"
    script = "sweeps/lr_search.py"
    model = LrSearchConfig

    @staticmethod
    def experiments(cfg: LrSearchConfig) -> list[Experiment]:
        from ray import tune

        from altgrad.tune.lr_searcher import GridThenEdge

        r = cfg.resources
        points = search_points(cfg)
        twins = searched_as(points)
        out = []
        for fmt, point in points.items():
            if fmt in twins:
                continue
            path = join(cfg.experiment_path, fmt)
            search = GridThenEdge(cfg.lr.grid, StateStore(path))
            param_space = {"key": point.key, "lr": tune.loguniform(cfg.lr.low, cfg.lr.high),
                           "tolerance": cfg.tolerance, **trial_limits(r.cpus_per_trial, r.gpu_per_trial)}
            grid = [trial_labels({"key": point.key, "lr": lr}, point.labels) for lr in cfg.lr.grid]
            out.append(Experiment(cfg, LrSearch.kind, path, {point.key: point},
                                  param_space, grid, len(cfg.lr.grid) + cfg.lr.samples, search_alg=search))
        return out

    @staticmethod
    def describe(cfg: LrSearchConfig, experiments: list[Experiment]) -> str:
        per_format = len(cfg.lr.grid) + cfg.lr.samples
        twins = searched_as(search_points(cfg))
        searched = len(cfg.formats) - len(twins)
        lines = [
            f"lr search {cfg.name}: {searched} format{'s' * (searched != 1)} searched × {per_format} trials = "
            f"{searched * per_format} trials ({cfg.optimizer}, precision {cfg.precision})",
            f"per format: learning rates {', '.join(f'{x:g}' for x in cfg.lr.grid)} first, then "
            f"{cfg.lr.samples} that halve (log scale) the stretch between the largest that trained stably and "
            "the smallest above it that did not (nothing stable: between the largest that ran without learning "
            f"and the smallest that diverged), within [{cfg.lr.low:g}, {cfg.lr.high:g}], "
            f"{samples_at_once(cfg.max_concurrent_trials)} at a time (none once that stretch holds no rate left to try)",
            *describe_resources(cfg, searched * per_format, lambda at_once: searched * (
                # one format after another: its grid, then its samples (`lr_searcher`'s window)
                math.ceil(len(cfg.lr.grid) / at_once)
                + math.ceil(cfg.lr.samples / min(samples_at_once(cfg.max_concurrent_trials), at_once)))),
            "formats: " + ", ".join(f"{f} (= {twins[f]}: {TWIN_NOTE})" if f in twins else f for f in cfg.formats),
        ]
        return "\n".join(lines)

    @staticmethod
    def summarize(cfg: LrSearchConfig, experiments: list[Experiment]) -> int:
        twins = searched_as(search_points(cfg))
        if is_remote(cfg.experiment_path):
            print(f"each format's trials: python -m altgrad trials "
                  f"{shlex.quote(join(cfg.experiment_path, '<format>'))} "
                  f"(formats: {', '.join(f for f in cfg.formats if f not in twins)}"
                  + "".join(f"; {f}: the trials of {twin}" for f, twin in twins.items())
                  + "); the largest-stable-lr table is made for local "
                  "storage only")
            return 0
        measured = {row["format"]: row for row in (
            stable_lr_row(split_name(exp.path)[1], load_experiment(exp.path), cfg.tolerance) for exp in experiments)}
        rows = [{**measured[twins[f]], "format": f, "same_as": twins[f]} if f in twins else measured[f]
                for f in cfg.formats]
        print(render_lr_table(rows, (cfg.lr.low, cfg.lr.high)))
        print(what_stable_means(cfg))
        path = Path(cfg.experiment_path) / LR_SEARCH_FILE
        path.write_text(json.dumps(rows, indent=1))
        print(f"results: {path}")
        return 0


# Why a format's row is another's (`searched_as`).
TWIN_NOTE = "an equivalent format, the same search"


def search_points(cfg: LrSearchConfig) -> dict[str, GridPoint]:
    """Each format's grid point: its run config with the search's optimizer, precision and seed."""
    seed = cfg.base_run.train.seed
    return {fmt: make_point(cfg, fmt, cfg.optimizer, cfg.precision, seed) for fmt in cfg.formats}


def searched_as(points: dict[str, GridPoint]) -> dict[str, str]:
    """Of each format's point (`search_points`), each format whose search would repeat an earlier
    format's, mapped to that format: every
    trial would train bit for bit like the earlier format's at the same rate (`grid.twin_of`),
    and given the same results the searcher asks for the same rates (`lr_searcher`). Its row in the
    table is that format's, marked `same_as`."""
    searched: list[GridPoint] = []
    twins: dict[str, str] = {}
    for point in points.values():
        if twin := twin_of(point, searched, lambda p: assigned_formats(p.run_config)):
            twins[point.format] = twin.format
        else:
            searched.append(point)
    return twins


def samples_at_once(max_concurrent_trials: int | None) -> int:
    """How many of a format's samples run at a time (`lr_searcher`'s window): one, unless the
    sweep's `max_concurrent_trials` lets more run."""
    return max_concurrent_trials or 1


def _evidence(record: TrialRecord) -> tuple[list[float], bool, str | None]:
    """What `trial_spec.verdict` reads of a trial's record, as its last report told the searcher:
    its val losses, whether that report was broken (a NaN step, a non-finite val loss), and its
    stop (None: it ran its budget)."""
    vals = record.val_series()[1]
    last = record.history[-1] if record.history else {}
    broken = last.get(LOSS_IS_NAN, 0) > 0 or (bool(vals) and not math.isfinite(vals[-1]))
    return vals, broken, None if record.stop_reason == StopReason.COMPLETED else record.stop_reason


def judged(record: TrialRecord, tolerance: float) -> tuple[bool, bool]:
    """(stable, diverged) of a trial's record: `trial_spec.verdict` of its `_evidence`. Stable
    takes the run's whole budget (a stopped trial's record says why it stopped)."""
    vals, broken, stop = _evidence(record)
    return verdict(vals[0] if vals else None, worst(vals), vals[-1] if vals else math.nan, broken, stop, tolerance)


def stability_edge(results: Iterable[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """(the largest learning rate that trained stably, the smallest above it that did not) of
    (rate, stable) results: the edge of stability lies between them; None on a side without one.
    The searcher's bracket (`lr_searcher.edge_bracket`) and the table (`stable_lr_row`) both read it."""
    results = list(results)
    low = max((lr for lr, stable in results if stable), default=None)
    return low, min((lr for lr, stable in results if not stable and (low is None or lr > low)), default=None)


# An unstable trial that ran its budget with a finite val loss (`why_unstable`).
NOT_LEARNING = "ran its steps without learning"


def why_unstable(record: TrialRecord) -> str:
    """Why a trial is not `stable`, as the table's lines say it: stopped (by the sweep or its
    trainer, with the reason), or, having run its budget, its val loss ended non-finite, rose above
    its first on the way, or did not fall far enough (`NOT_LEARNING`: too small a rate, or too
    short a run)."""
    vals, broken, stop = _evidence(record)
    if stop is not None:
        return f"was stopped ({stop})"
    if vals and not math.isfinite(vals[-1]):
        return "ended with a non-finite val loss"
    if not judged(record, 0.0)[1]:
        return NOT_LEARNING
    if broken:
        return "diverged (a non-finite step at its end)"
    # where it ended too: a run that spiked and recovered may end lower than a stable one
    return f"diverged (its val loss rose to {worst(vals):.4g}, above its first, {vals[0]:.4g}; it ended at {vals[-1]:.4g})"


def learning_window(results: Iterable[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """Where no rate trained stably, from (rate, diverged) results: (the largest rate that ran
    without learning below the smallest that diverged, that smallest): a rate that learns, if any,
    lies between; None on a side without one. The searcher's bracket and the table read it."""
    results = list(results)
    high = min((lr for lr, gone in results if gone), default=None)
    return max((lr for lr, gone in results if not gone and (high is None or lr < high)), default=None), high


def stable_lr_row(fmt: str, records: list[TrialRecord], tolerance: float) -> dict[str, Any]:
    """A format's result: the largest rate that trained stably (and its final val loss), the
    smallest that did not and why (a rate too small to learn within `tolerance` counts: it may lie
    below), and the smallest unstable rate above the largest stable one, the edge's other side
    (None: no rate above it failed, so the edge lies past the range)."""
    done = [r for r in records if r.status == TrialStatus.TERMINATED and "lr" in r.params]
    verdicts = [(r.params["lr"], *judged(r, tolerance), r) for r in done]
    largest, above = stability_edge((lr, ok) for lr, ok, _, _ in verdicts)
    best = next((r for lr, ok, _, r in verdicts if ok and lr == largest), None)
    smallest = min(((lr, r) for lr, ok, _, r in verdicts if not ok), default=None, key=lambda x: x[0])
    next_up = next((r for lr, ok, _, r in verdicts if not ok and lr == above), None) if largest is not None else None
    # nothing stable: where a rate that learns would lie
    idle, gone = learning_window((lr, d) for lr, _, d, _ in verdicts) if largest is None else (None, None)
    by_rate = {lr: r for lr, _, _, r in verdicts}
    return {
        "format": fmt,
        "largest_stable_lr": largest,
        "val_loss_there": best.summary.get("final_val_loss") if best else None,
        "smallest_unstable_lr": smallest[0] if smallest else None,
        "smallest_unstable_why": why_unstable(smallest[1]) if smallest else None,
        "unstable_above": next_up.params["lr"] if next_up else None,
        "unstable_above_why": why_unstable(next_up) if next_up else None,
        "idle_up_to": idle,  # (nothing stable) the largest rate that ran without learning below ...
        "idle_why": why_unstable(by_rate[idle]) if idle is not None else None,
        "diverged_from": gone,  # ... the smallest that diverged
        "diverged_why": why_unstable(by_rate[gone]) if gone is not None else None,
        "trials": len(done),
        "unfinished": len(records) - len(done),
        "same_as": None,  # (a format searched by an equivalent one's trials: `searched_as`)
    }


def what_stable_means(cfg: LrSearchConfig) -> str:
    """The table's criterion, and what one run per rate can and cannot say."""
    t = cfg.base_run.train
    by = f" by more than {cfg.tolerance * 100:g} %" if cfg.tolerance else ""
    return (f"stable: ran its {t.max_steps} steps, no val loss over {RISE_MARGIN * 100:g} % above its first, the "
            f"last finite and below the first{by}; each rate ran once (seed {t.seed}): near the edge another seed "
            "may judge a rate otherwise")


def render_lr_table(rows: list[dict[str, Any]], lr_range: tuple[float, float]) -> str:
    """The table, then a line per format saying where its edge lies: between its largest stable
    rate and the next one tried above it, and what that one did; past the searched range
    `(lr.low, lr.high)`, whose bound must move; or past the rates tried inside it, which more
    samples reach."""
    def num(x: float | None, spec: str) -> str:
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)

    lines = [f"{'format':<7} {'largest stable lr':>17} {'val loss there':>14} {'next unstable above':>19} "
             f"{'smallest unstable lr':>20} {'trials':>6}"]
    lines += [f"{r['format']:<7} {num(r['largest_stable_lr'], '.3g'):>17} {num(r['val_loss_there'], '.4f'):>14} "
              f"{num(r['unstable_above'], '.3g'):>19} {num(r['smallest_unstable_lr'], '.3g'):>20} {r['trials']:>6}"
              + (f"  = {r['same_as']}" if r.get("same_as") else "") for r in rows]
    low, high = lr_range
    for r in rows:
        if r.get("same_as"):
            lines.append(f"{r['format']}: the trials of {r['same_as']} ({TWIN_NOTE}: one measurement)")
            continue
        largest, smallest = r["largest_stable_lr"], r["smallest_unstable_lr"]
        if r["unstable_above"] is not None:
            lines.append(f"{r['format']}: the edge lies between {largest:.3g} and {r['unstable_above']:.3g}, which "
                         f"{r['unstable_above_why']}")
        elif largest is not None:
            lines.append(f"{r['format']}: the range's top, lr.high ({high:g}), trained stably; the edge lies "
                         "above the range (raise lr.high)" if largest >= high else
                         f"{r['format']}: no rate tried above {largest:.3g} failed; the edge lies higher "
                         "(more samples, or a larger lr.high)")
        elif smallest is not None:  # nothing stable: between the rates too small and too large
            idle, gone = r["idle_up_to"], r["diverged_from"]
            head = f"{r['format']}: no rate tried trained stably"
            if idle is not None and gone is not None:
                lines.append(f"{head}: {idle:.3g} {r['idle_why']}, {gone:.3g} {r['diverged_why']}; a rate that "
                             "learns, if any, lies between (more samples, or more steps)")
            elif idle is not None:
                lines.append(f"{head}: up to {idle:.3g}, the largest, {r['idle_why']}; " + (
                    f"the edge lies above the range (raise lr.high ({high:g}), or run more steps)" if idle >= high
                    else "the edge lies higher (more samples, a larger lr.high, or more steps)"))
            else:
                lines.append(f"{head}; the smallest, {gone:.3g}, {r['diverged_why']}: " + (
                    "the edge lies below the range (lower lr.low)" if gone <= low else
                    "the edge lies lower (more samples, or a smaller lr.low)"))
    return "\n".join(lines)
