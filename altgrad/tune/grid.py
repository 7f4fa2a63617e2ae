"""The grid of a format ablation: formats × optimizers × layer precisions × extra axes × seeds.

bf16 is the baseline and quantizes nothing, so it runs once per optimizer, seed and value of each
extra axis that applies to it (axes under `quant.` do not), not once per layer precision. A format
that quantizes every tensor exactly like an earlier one of the same cell (`quant.equivalence`: e1m6
≡ e0m7 under amax scaling), or a layer precision that quantizes the same layers in the same formats
as an earlier one for that format (a custom policy that puts attention in e5m2 is `all` for e5m2),
is not run again: its point is an alias (`same_as`) that readers list under its own name, marked
as one measurement. Every point carries its validated run config, so a
bad combination fails here, before Ray starts, with the point and the field named.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from altgrad.config import ConfigError, RunConfig, deep_merge, flattened, nested
from altgrad.experiment import axis_names, axis_value_text, overrides_text
from altgrad.precision import BASELINE, policy_rules
from altgrad.quant.equivalence import quantize_identically
from altgrad.run_model import assigned_formats, check_layer_policy
from altgrad.tune.config import (
    AxisValue,
    SweepConfig,
    SweepSettings,
    absolute_data_paths,
    asha_milestones,
)


@dataclass(frozen=True)
class GridPoint:
    key: str  # e.g. "e4m3-adamw-all-rounding=stochastic-s42": names the trial and its directory
    format: str
    optimizer: str
    precision: str
    seed: int
    run: dict[str, Any] = field(repr=False)  # a validated RunConfig, JSON-ready, data paths absolute
    axes: dict[str, AxisValue] = field(default_factory=dict)  # extra-axis values that apply here
    same_as: str | None = None  # an equivalent format's point whose trial measures this one
    reference: str | None = None  # the bf16 point of the same optimizer, seed and axes, if any

    @property
    def run_config(self) -> RunConfig:
        return RunConfig.model_validate(self.run)

    @property
    def labels(self) -> dict[str, Any]:
        """What readers need to place the trial in the grid (no run config)."""
        return {k: v for k, v in asdict(self).items() if k != "run"}


def applies_to_baseline(axis: str) -> bool:
    """bf16 quantizes nothing, so the quantizer's settings (`quant.*`) do not change it."""
    return not axis.startswith("quant.")


def point_key(fmt: str, optimizer: str, precision: str, seed: int,
              axes: dict[str, AxisValue] | None = None, names: dict[str, str] | None = None) -> str:
    names = names or axis_names(list(axes or {}))
    extra = "".join(f"-{names[path]}={axis_value_text(v)}" for path, v in (axes or {}).items())
    return f"{fmt}-{optimizer}-{precision}{extra}-s{seed}"


def make_point(settings: SweepSettings, fmt: str, optimizer: str, precision: str, seed: int,
               rules: list[dict[str, str]] | None = None, extra: dict[str, Any] | None = None,
               axes: dict[str, AxisValue] | None = None, names: dict[str, str] | None = None) -> GridPoint:
    """One trial's run: the base (plus `extra`, then the axis values) with format, precision
    (preset or custom `rules`) and seed set."""
    axes = axes or {}
    key = point_key(fmt, optimizer, precision, seed, axes, names)
    quant: dict[str, Any] = {"format": fmt, "precision": rules if rules is not None else precision}
    if fmt == BASELINE:
        quant["master_weights"] = "fp32"  # the baseline has no 8-bit format to store weights in
    layers = [extra or {}, *(nested(path, v) for path, v in axes.items()),
              {"quant": quant, "optim": {"name": optimizer}, "train": {"seed": seed}}]
    overrides: dict[str, Any] = {}
    for layer in layers:
        overrides = deep_merge(overrides, layer)
    try:
        run = settings.run_config(overrides)
        check_layer_policy(run)
    except ConfigError as e:
        raise ConfigError(f"grid point {key}: {e}") from None
    return GridPoint(key, fmt, optimizer, precision, seed, absolute_data_paths(run.model_dump(mode="json")),
                     axes=dict(axes))


def build_grid(cfg: SweepConfig) -> list[GridPoint]:
    """Every point, in a fixed order (seed, optimizer, extra axes, format, precision): the order
    trials start in, bf16 first of each group wherever `grid.formats` lists it: ASHA judges a
    quantized trial against its bf16 at each rung, and holds it there until bf16 has reached it.
    Points with `same_as` set are not run (`trials_to_run`)."""
    grid = cfg.grid
    seeds = grid.seeds or [cfg.base_run.train.seed]
    names = axis_names(list(grid.axes))
    combos = [dict(zip(grid.axes, values, strict=True)) for values in itertools.product(*grid.axes.values())]
    points: dict[str, GridPoint] = {}
    assigned: dict[str, dict[str, Any]] = {}

    def formats_of(p: GridPoint) -> dict[str, Any]:  # (each builds a model on the meta device: once)
        if p.key not in assigned:
            assigned[p.key] = assigned_formats(p.run_config)
        return assigned[p.key]

    for seed, optimizer, axes in itertools.product(seeds, grid.optimizer_names, combos):
        baseline_axes = {p: v for p, v in axes.items() if applies_to_baseline(p)}
        reference = (point_key(BASELINE, optimizer, "all", seed, baseline_axes, names)
                     if BASELINE in grid.formats else None)
        for fmt in sorted(grid.formats, key=lambda f: f != BASELINE):
            for precision in ["all"] if fmt == BASELINE else grid.precisions:
                rules = None
                if precision in grid.policies:  # written out, so each trial's config.yaml says it
                    rules = [{"pattern": p, "format": f} for p, f in policy_rules(
                        [(r.pattern, r.format) for r in grid.policies[precision]], fmt)]
                point_axes = baseline_axes if fmt == BASELINE else axes
                point = make_point(cfg, fmt, optimizer, precision, seed, rules,
                                   grid.format_overrides.get(fmt), point_axes, names)
                if point.key in points:  # bf16 again for an axis value that does not apply to it
                    continue
                twin = twin_of(point, points.values(), formats_of)
                points[point.key] = GridPoint(
                    **{**asdict(point), "same_as": (twin.same_as or twin.key) if twin else None,
                       "reference": None if fmt == BASELINE else reference})
    return list(points.values())


def trials_to_run(points: list[GridPoint]) -> list[GridPoint]:
    return [p for p in points if p.same_as is None]


def twin_of(point: GridPoint, earlier: Iterable[GridPoint],
            formats_of: Callable[[GridPoint], dict[str, Any]]) -> GridPoint | None:
    """The first of the `earlier` points whose training `point` would repeat bit for bit
    (`_trains_like`), so that its measurement is that point's; None for bf16, which quantizes
    nothing and is every grid's baseline."""
    if point.format == BASELINE:
        return None
    return next((p for p in earlier if _trains_like(p, point, formats_of)), None)


def _trains_like(earlier: GridPoint, other: GridPoint, formats_of: Callable[[GridPoint], dict[str, Any]]) -> bool:
    """Whether `other` would train bit for bit like an earlier point (measured, or an alias that
    its own measured point trains like): its format quantizes identically under the run's scaling,
    or its layer precision quantizes the same layers in the same formats (`formats_of`: a custom
    policy that, for this format, is a preset; two presets always differ), and nothing else of the
    run differs."""
    if earlier.format == BASELINE:
        return False
    if (earlier.optimizer, earlier.seed, earlier.axes) != (other.optimizer, other.seed, other.axes):
        return False
    if earlier.precision != other.precision:
        custom = isinstance(earlier.run["quant"]["precision"], list) or isinstance(other.run["quant"]["precision"], list)
        return (custom and earlier.format == other.format
                and _without_precision(earlier.run) == _without_precision(other.run)
                and formats_of(earlier) == formats_of(other))
    quant = other.run["quant"]
    amax_scaled = quant["scaling"]["mode"] != "none"
    # An emergency mantissa shift moves the two along different format chains.
    unshifted = other.run["stability"]["shift_patience"] is None
    return (unshifted and quantize_identically(earlier.format, other.format, amax_scaled)
            and _without_format(earlier.run, earlier.format) == _without_format(other.run, other.format))


def _without_precision(run: dict[str, Any]) -> dict[str, Any]:
    """The run with its layer precision (a preset's name or rules) blanked out."""
    return {**run, "quant": dict(run["quant"], precision=None)}


def _without_format(run: dict[str, Any], fmt: str) -> dict[str, Any]:
    """The run with its grid format blanked out (in `quant.format` and the precision rules)."""
    quant = dict(run["quant"], format=None)
    if isinstance(quant["precision"], list):
        quant["precision"] = [{**r, "format": None if r["format"] == fmt else r["format"]}
                              for r in quant["precision"]]
    return {**run, "quant": quant}


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


def describe_resources(settings: SweepSettings, n_trials: int,
                       waves: Callable[[int], int] | None = None, max_steps: int | None = None) -> list[str]:
    """The resources lines of a plan; `waves(at_once)`: how many rounds of trials the sweep runs
    where it cannot fill every slot each round (by default, n_trials over the slots); `max_steps`:
    the longest trial's budget where some differ from the base's (`grid.format_overrides`)."""
    r = settings.resources
    cpus, gpus = machine_resources()
    at_once = concurrency(settings, cpus, gpus)
    run = settings.base_run
    m, t = run.model, run.train
    lines = [
        f"preset {settings.preset}: per trial {r.cpus_per_trial} CPU, {r.gpu_per_trial:g} GPU"
        + (f", max {settings.max_concurrent_trials} at once" if settings.max_concurrent_trials else ""),
        f"this machine: {cpus} CPUs, {gpus} GPUs -> {at_once} trial(s) at a time"
        + ("" if at_once else "  (NOT ENOUGH for one trial: lower resources.* or use preset cpu)"),
        f"each trial: up to {max_steps or t.max_steps} steps of a {m.n_layer}-layer, {m.n_embd}-wide model "
        f"(block {m.block_size}, batch {t.batch_size}) on data.source {run.data.source}"
        + (f" (max_docs {run.data.max_docs})" if run.data.max_docs else "")
        + f", checkpoint every {t.checkpoint_interval} steps",
    ]
    if at_once:
        rounds = waves(at_once) if waves else math.ceil(n_trials / at_once)
        lines.append(f"{n_trials} trial{'s' * (n_trials != 1)} in about {rounds} wave{'s' * (rounds != 1)} "
                     f"of up to {at_once}")
    lines.append(f"experiment dir: {settings.experiment_path}")
    return lines


def describe_grid(cfg: SweepConfig, points: list[GridPoint]) -> str:
    """The `--dry-run` text: grid size, resources, early stopping, the estimate, one line per point."""
    from altgrad.tune.estimate import estimate_lines

    grid = cfg.grid
    runs = trials_to_run(points)
    quantized = [f for f in grid.formats if f != BASELINE]
    optimizers = grid.optimizer_names
    axes = "".join(f" × {len(v)} {path}" for path, v in grid.axes.items())
    seeds = len(grid.seeds or [None])
    parts = []
    if quantized:
        parts.append(f"{_n(len(quantized), 'format')} × {_n(len(optimizers), 'optimizer')} × "
                     f"{_n(len(grid.precisions), 'precision')}{axes}")
    if BASELINE in grid.formats:
        applying = "".join(f" × {len(v)} {p}" for p, v in grid.axes.items() if applies_to_baseline(p))
        parts.append(f"{BASELINE} × {_n(len(optimizers), 'optimizer')}{applying}")
    size = " + ".join(parts) + f", × {_n(seeds, 'seed')}"
    aliases = len(points) - len(runs)
    lines = [f"sweep {cfg.name}: {len(runs)} trials = {size}"
             + (f", less {aliases} points measured by an equivalent one" if aliases else ""),
             *describe_resources(cfg, len(runs), max_steps=max(p.run["train"]["max_steps"] for p in runs))]
    if cfg.asha.enabled:
        a = cfg.asha
        rungs = ", ".join(str(m) for m in asha_milestones(a.grace_period, a.reduction_factor, cfg.max_t))
        lines.append(f"early stopping at rungs (steps {rungs or 'none'}) on {a.metric}: only broken "
                     f"trials stop (non-finite, or more than {100 * a.tolerance:g} % behind {BASELINE} of "
                     "the same optimizer and seed; in a grid without it, the rung's best)")
    if overridden := {f: flat for f, o in grid.format_overrides.items() if f in grid.formats and (flat := flattened(o))}:
        lines.append("settings by format (grid.format_overrides): " + "; ".join(
            f"{f}: {overrides_text(o)}" for f, o in overridden.items()))
    if cfg.stopper.enabled:
        s = cfg.base_run.stability
        lines.append(f"stability stopper: {s.nan_patience} NaN steps in a row, or bit-stall >= "
                     f"{s.stall_stop:g} for {s.stall_stop_reports} reports in a row (base.stability; a "
                     "trial whose own run sets other levels is judged by those)")
    cpus, gpus = machine_resources()
    can_measure = cfg.preset == "cpu" or gpus > 0
    if cfg.resources.gpu_per_trial > 0 and gpus == 0:  # planning a GPU run here: one GPU, as planned
        cpus, gpus = max(cpus, math.ceil(1 / cfg.resources.gpu_per_trial) * cfg.resources.cpus_per_trial), 1
        lines.append("estimate for one GPU (this machine has none):")
    lines += estimate_lines(cfg, [p.run_config for p in runs], concurrency(cfg, cpus, gpus), can_measure)
    names = axis_names(list(grid.axes))
    width = max(len(p.key) for p in points)
    lines += ["", f"  {'':>3}  {'trial':<{width}}  {'format':<6} {'optimizer':<9} {'precision':<9} "
              + "".join(f"{names[a]:<12} " for a in grid.axes) + "seed"]
    for p in points:
        axis_cells = "".join(f"{axis_value_text(p.axes[a]) if a in p.axes else '-':<12} " for a in grid.axes)
        note = f"  = {p.same_as} ({_alias_kind(p, points)}: one measurement)" if p.same_as else ""
        index = "" if p.same_as else str(runs.index(p))
        lines.append(f"  {index:>3}  {p.key:<{width}}  {p.format:<6} {p.optimizer:<9} {p.precision:<9} "
                     f"{axis_cells}{p.seed}{note}")
    return "\n".join(lines)


def _alias_kind(point: GridPoint, points: list[GridPoint]) -> str:
    """How an alias point equals the point that measures it."""
    measured = next(p for p in points if p.key == point.same_as)
    kinds = ["equivalent format"] if measured.format != point.format else []
    if measured.precision != point.precision:
        kinds.append(f"the same layers in the same formats as precision {measured.precision}")
    return "; ".join(kinds)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
