"""The format ablation: every grid point as one trial, ASHA and the stability stopper on top.

At the end the trial table is printed; the entry point (`sweeps/format_ablation.py`) then has the
report written, so this package never imports its reader.
"""

from __future__ import annotations

import shlex

from altgrad.experiment import ExperimentError, read_experiment
from altgrad.trial_table import render_table, trial_row
from altgrad.tune.asha import StabilityRungs
from altgrad.tune.config import SweepConfig
from altgrad.tune.grid import build_grid, describe_grid, trials_to_run
from altgrad.tune.runner import Experiment
from altgrad.tune.store import StateStore
from altgrad.tune.trial_spec import trial_labels, trial_limits


class FormatAblation:
    kind = "format_ablation"
    script = "sweeps/format_ablation.py"
    model = SweepConfig

    @staticmethod
    def experiments(cfg: SweepConfig) -> list[Experiment]:
        from ray import tune

        points = build_grid(cfg)
        runs = trials_to_run(points)
        r = cfg.resources
        param_space = {"key": tune.grid_search([p.key for p in runs]),
                       **trial_limits(r.cpus_per_trial, r.gpu_per_trial)}
        a = cfg.asha
        scheduler = StabilityRungs(
            StateStore(cfg.experiment_path), metric=a.metric, mode=a.mode, max_t=cfg.max_t,
            grace_period=a.grace_period, reduction_factor=a.reduction_factor, tolerance=a.tolerance,
            references={p.key: p.reference for p in runs},
        ) if a.enabled else None
        trials = [trial_labels({"key": p.key}, p.labels) for p in points]  # aliases too, for readers
        return [Experiment(cfg, FormatAblation.kind, cfg.experiment_path, {p.key: p for p in runs},
                           param_space, trials, len(runs), scheduler=scheduler)]

    @staticmethod
    def describe(cfg: SweepConfig, experiments: list[Experiment]) -> str:
        return describe_grid(cfg, build_grid(cfg))

    @staticmethod
    def summarize(cfg: SweepConfig, experiments: list[Experiment]) -> int:
        """Print the trial table, of an experiment on local disk or on object storage, as `python -m
        altgrad trials` does; 1 (with that command, to retry) when it cannot be read."""
        try:
            records = read_experiment(cfg.experiment_path).records
        except ExperimentError as e:
            print(f"trial table failed ({e}); retry: python -m altgrad trials {shlex.quote(cfg.experiment_path)}")
            return 1
        print(render_table([trial_row(r) for r in records]))
        return 0
