"""The config Ray hands each trial, and the names derived from it (driver and worker agree here).

A trial config is small: `{"key": <grid point key>, "limits": {"cpus", "gpu_fraction"}}`, plus
`"lr"` when a searcher samples the learning rate, and in a learning-rate search its `"tolerance"`
(`learning`). The grid points' run configs (with every threshold a trial is judged by, its
`stability`) reach the trainable separately (`tune.with_parameters`), so Ray's status tables,
`params.json` and experiment snapshots stay small.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from altgrad.config import RunConfig, deep_merge
from altgrad.experiment import StopReason, exact_g
from altgrad.metrics import is_diagnostic_step, is_logged_step

SEARCHED = ("lr",)  # hyper-parameters a searcher may sample on top of the grid point


def sampled(config: dict[str, Any]) -> dict[str, Any]:
    return {k: config[k] for k in SEARCHED if k in config}


def trial_limits(cpus: int, gpu_fraction: float) -> dict[str, Any]:
    """The part of every trial config that is the same for all trials of a sweep."""
    return {"limits": {"cpus": cpus, "gpu_fraction": gpu_fraction}}


# How far above its first a val loss must rise for the run to have diverged: above the wobble of a
# rate too small to learn, far below a blow-up (measured: docs/design.md, the lr search's audit).
RISE_MARGIN = 0.01


def verdict(first_val_loss: float | None, worst_val_loss: float, val_loss: float, broken: bool,
            stop: str | None, tolerance: float) -> tuple[bool, bool]:
    """(stable, diverged) of a run from its evaluations so far -- the first, the largest (+inf
    after a non-finite one: `worst`), the latest -- whether its latest report is `broken` (a NaN
    step, a non-finite val loss), and the stop its stability limits call for there (`stop`, a
    `StopReason`, or None). The trainable says it in each report; the learning-rate search's
    table, of a record (`lr_search.judged`).

    Diverged: broken, stopped for NaN, or a val loss that rose more than RISE_MARGIN above the
    first, whatever it fell back to (a blown-up run can come back to chance, below its first).
    Stable: not diverged, not stopped, and the latest val loss below the
    first by more than `tolerance`, a fraction of it (the search's setting). Neither: the run ran
    without learning (too small a rate, too short a run, weights stalled in their format), and the
    search looks above it, where it looks below a diverged one."""
    gone = broken or stop == StopReason.NAN or (
        first_val_loss is not None and worst_val_loss > first_val_loss * (1 + RISE_MARGIN))
    stable = (not gone and stop is None and first_val_loss is not None and math.isfinite(val_loss)
              and val_loss < first_val_loss * (1 - tolerance))
    return stable, gone


def worst(val_losses: Iterable[float]) -> float:
    """The largest of val losses, +inf if one is NaN or inf (`verdict`'s `worst_val_loss`); -inf
    for none."""
    return max((math.inf if math.isnan(v) else v for v in val_losses), default=-math.inf)


def learning_tolerance(config: dict[str, Any]) -> float:
    """The `tolerance` a trial's run is judged stable by (`verdict`): its learning-rate search's; 0 for a
    grid's trial (a format ablation searches no learning rate)."""
    return config.get("tolerance", 0.0)


def stall_reports_in_run(run: RunConfig) -> int:
    """How many reports of a full run carry `quant/bit_stall_rate`, i.e. how long the stopper's
    stall streak can get: the logged steps that are diagnostic steps."""
    t = run.train
    return sum(is_diagnostic_step(t, s) and is_logged_step(t, s) for s in range(1, t.max_steps + 1))


def trial_key(config: dict[str, Any]) -> str:
    """The grid key, plus the sampled values: unique within an experiment. The learning rate is
    written with as few significant digits as read back as the same number, at least 3 (`0.01`,
    `1e+03`): Optuna may sample two that agree to 3 digits, and a shared key would be a shared
    trial directory."""
    key = config["key"]
    if "lr" in config:
        key += "-lr" + exact_g(config["lr"], 3)
    return key


def trial_labels(config: dict[str, Any], point_labels: dict[str, Any]) -> dict[str, Any]:
    """What the trial table needs: key, format, optimizer, precision, seed, sampled params."""
    return {**point_labels, "key": trial_key(config), "params": sampled(config)}


def trial_run_config(config: dict[str, Any], run: dict[str, Any]) -> RunConfig:
    """The grid point's run with the sampled values applied, computing with the trial's CPUs as
    its threads (`train.threads`: a CPU run's numbers depend on them, so they are the run's)."""
    run = deep_merge(run, {"train": {"threads": config["limits"]["cpus"]}})
    if "lr" in config:
        run = deep_merge(run, {"optim": {"lr": config["lr"]}})
    return RunConfig.model_validate(run)


def trial_dirname(trial: Any) -> str:
    """`<key>_<trial id>`: readable, and unique even if a key recurs in a restarted experiment."""
    return f"{trial_key(trial.config)}_{trial.trial_id}"


def trial_name(trial: Any) -> str:
    return trial_key(trial.config)
