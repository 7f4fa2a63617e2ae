"""The format ablation: every grid point as one trial, ASHA and the stability stopper on top.

At the end the trial table is printed and the report is written to `<experiment>/report/`.
"""

from __future__ import annotations

from pathlib import Path

from altgrad.experiment import load_experiment
from altgrad.tune.asha import StabilityRungs
from altgrad.tune.config import SweepConfig
from altgrad.tune.grid import build_grid, describe_grid, trials_to_run
from altgrad.tune.runner import Experiment
from altgrad.tune.store import StateStore
from altgrad.tune.trial_spec import trial_labels, trial_limits
from altgrad.tune.trials import render_table, trial_row


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
                       **trial_limits(r.cpus_per_trial, r.gpu_per_trial, cfg.stopper.stall_threshold)}
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
        """Write the report, then print the trial table; 1 if the report could not be written."""
        if "://" in cfg.experiment_path:
            print(f"trial table and report: copy {cfg.experiment_path} to local disk, then run "
                  "`python -m altgrad trials DIR` and `python -m altgrad report DIR`")
            return 0
        from altgrad.report import write_report

        exp_dir = Path(cfg.experiment_path)
        records = load_experiment(exp_dir)
        missing = [r.key for r in records if r.status == "PENDING"]
        code = 0
        try:
            path = write_report(records, exp_dir / "report", missing=missing, title=f"AltGrad report: {cfg.name}")
            print(f"report: {path}")
        except Exception as e:  # the sweep's data is safe; say how to retry the report alone
            print(f"report failed ({type(e).__name__}: {e}); retry: python -m altgrad report {exp_dir} "
                  f"--out {exp_dir / 'report'}")
            code = 1
        print(render_table([trial_row(r) for r in records]))
        return code
