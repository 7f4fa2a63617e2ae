"""The grid of a format ablation: formats × optimizers × layer precisions × seeds.

bf16 is the baseline and quantizes nothing, so it runs once per optimizer (and seed), not once per
layer precision. Every point carries its validated run config, so a bad combination fails here,
before Ray starts, with the point and the field named.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from altgrad.config import BASELINE, ConfigError, deep_merge
from altgrad.tune.asha import asha_milestones
from altgrad.tune.config import FORMAT_PLACEHOLDER, SweepConfig, SweepSettings, absolute_data_paths


@dataclass(frozen=True)
class GridPoint:
    key: str  # e.g. "e4m3-adamw-all-s42": names the trial and its directory
    format: str
    optimizer: str
    precision: str
    seed: int
    run: dict[str, Any] = field(repr=False)  # a validated RunConfig, JSON-ready, data paths absolute

    @property
    def labels(self) -> dict[str, Any]:
        """What readers need to place the trial in the grid (no run config)."""
        return {k: v for k, v in asdict(self).items() if k != "run"}


def point_key(fmt: str, optimizer: str, precision: str, seed: int) -> str:
    return f"{fmt}-{optimizer}-{precision}-s{seed}"


def make_point(settings: SweepSettings, fmt: str, optimizer: str, precision: str, seed: int,
               rules: list[dict[str, str]] | None = None, extra: dict[str, Any] | None = None) -> GridPoint:
    """One trial's run: the base (plus `extra`) with format, precision (preset or custom `rules`)
    and seed set."""
    key = point_key(fmt, optimizer, precision, seed)
    quant: dict[str, Any] = {"format": fmt, "precision": rules if rules is not None else precision}
    if fmt == BASELINE:
        quant["master_weights"] = "fp32"  # the baseline has no 8-bit format to store weights in
    point = {"quant": quant, "optim": {"name": optimizer}, "train": {"seed": seed}}
    try:
        run = settings.run_config(deep_merge(extra or {}, point))
    except ConfigError as e:
        raise ConfigError(f"grid point {key}: {e}") from None
    return GridPoint(key, fmt, optimizer, precision, seed, absolute_data_paths(run.model_dump(mode="json")))


def build_grid(cfg: SweepConfig) -> list[GridPoint]:
    """Points in a fixed order (seed, optimizer, format, precision): the order trials start in."""
    grid = cfg.grid
    seeds = grid.seeds or [cfg.run_config({}).train.seed]
    points = []
    for seed in seeds:
        for optimizer in grid.optimizer_names:
            for fmt in grid.formats:
                for precision in ["all"] if fmt == BASELINE else grid.precisions:
                    rules = None
                    if precision in grid.policies:
                        rules = [{"pattern": r.pattern,
                                  "format": fmt if r.format == FORMAT_PLACEHOLDER else r.format}
                                 for r in grid.policies[precision]]
                    points.append(make_point(cfg, fmt, optimizer, precision, seed, rules,
                                             grid.format_overrides.get(fmt)))
    return points


def machine_resources() -> tuple[int, int]:
    """(CPUs, GPUs) of this machine, without starting Ray."""
    import torch

    return os.cpu_count() or 1, torch.cuda.device_count() if torch.cuda.is_available() else 0


def concurrency(settings: SweepSettings, cpus: int, gpus: int) -> int:
    """How many trials run at once on `cpus` and `gpus`."""
    r = settings.resources
    limits = [cpus // r.cpus_per_trial]
    if r.gpu_per_trial > 0:
        limits.append(math.floor(gpus / r.gpu_per_trial + 1e-9))
    if settings.max_concurrent_trials:
        limits.append(settings.max_concurrent_trials)
    return max(0, min(limits))


def describe_resources(settings: SweepSettings, n_trials: int) -> list[str]:
    r = settings.resources
    cpus, gpus = machine_resources()
    at_once = concurrency(settings, cpus, gpus)
    run = settings.run_config({})
    m, t = run.model, run.train
    lines = [
        f"preset {settings.preset}: per trial {r.cpus_per_trial} CPU, {r.gpu_per_trial:g} GPU"
        + (f", max {settings.max_concurrent_trials} at once" if settings.max_concurrent_trials else ""),
        f"this machine: {cpus} CPUs, {gpus} GPUs -> {at_once} trial(s) at a time"
        + ("" if at_once else "  (NOT ENOUGH for one trial: lower resources.* or use preset cpu)"),
        f"each trial: up to {t.max_steps} steps of a {m.n_layer}-layer, {m.n_embd}-wide model "
        f"(block {m.block_size}, batch {t.batch_size}), checkpoint every {t.checkpoint_interval} steps",
    ]
    if at_once:
        lines.append(f"{n_trials} trials in about {math.ceil(n_trials / at_once)} waves of {at_once}")
    lines.append(f"experiment dir: {settings.experiment_path}")
    return lines


def describe_grid(cfg: SweepConfig, points: list[GridPoint]) -> str:
    """The `--dry-run` text: grid size, resources, early stopping, then one line per trial."""
    grid = cfg.grid
    quantized = [f for f in grid.formats if f != BASELINE]
    optimizers = grid.optimizer_names
    seeds = len(grid.seeds or [None])
    parts = []
    if quantized:
        parts.append(f"{_n(len(quantized), 'format')} × {_n(len(optimizers), 'optimizer')} × "
                     f"{_n(len(grid.precisions), 'precision')}")
    if BASELINE in grid.formats:
        parts.append(f"{BASELINE} × {_n(len(optimizers), 'optimizer')}")
    size = " + ".join(parts) + (f", × {seeds} seeds" if seeds > 1 else "")
    lines = [f"sweep {cfg.name}: {len(points)} trials = {size}", *describe_resources(cfg, len(points))]
    if cfg.asha.enabled:
        rungs = ", ".join(str(m) for m in asha_milestones(cfg.asha.grace_period, cfg.asha.reduction_factor, cfg.max_t))
        lines.append(f"ASHA on {cfg.asha.metric} ({cfg.asha.mode}): rungs at steps {rungs or 'none'}, "
                     f"keeps the best 1/{cfg.asha.reduction_factor:g} at each")
    if cfg.stopper.enabled:
        s = cfg.stopper
        lines.append(f"stability stopper: {s.nan_patience} NaN steps in a row, or bit-stall >= "
                     f"{s.stall_threshold:g} for {s.stall_reports} reports in a row")
    width = max(len(p.key) for p in points)
    lines.append("")
    lines += [f"  {i:>3}  {p.key:<{width}}  {p.format:<6} {p.optimizer:<9} {p.precision:<8} seed {p.seed}"
              for i, p in enumerate(points)]
    return "\n".join(lines)



def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
