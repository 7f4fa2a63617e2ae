"""Sweep configuration: one pydantic model per entry point, validated whole before Ray starts.

Layering, lowest priority first: the sweep preset (`cpu` / `gpu`, auto from CUDA) < the YAML file
< its `per_preset.<preset>:` section < its `smoke:` section (with `--smoke`) < `--set key=value`.
`base` is a RunConfig-shaped mapping shared by every trial; it is validated here through
`RunConfig` (errors say `base.optim.lr: ...`), the other presets' sections are validated too (a
gpu-only typo fails on a cpu machine), and every grid point is validated when the grid is built, so
nothing is written before a typo is caught.
"""

from __future__ import annotations

import json
from functools import cached_property, reduce
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar, get_args

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from altgrad.config import (
    PRESETS,
    ConfigError,
    DataConfig,
    LayerRule,
    RunConfig,
    StrictModel,
    apply_overrides,
    deep_merge,
    describe_validation_error,
    flattened,
    format_name,
    leaf_field,
    nested,
    one_of,
    precision_name,
    read_yaml,
    resolve_preset,
)
from altgrad.metrics import EVERY_REPORT, VAL_LOSS
from altgrad.precision import BASELINE, PRECISION_PRESETS
from altgrad.remote import is_remote, join
from altgrad.tune.trial_spec import stall_reports_in_run

# Run settings every sweep sets in each trial itself (-> the sweep key that sets them): a trial
# computes with its CPUs as threads (`trial_spec.trial_run_config`).
TRIAL_FIELDS = {"train.threads": "resources.cpus_per_trial"}
# Run settings the grid sets itself (-> the sweep key that sets them): not allowed as extra axes.
FIXED_AXES = {"quant.format": "grid.formats", "optim.name": "grid.optimizers",
              "quant.precision": "grid.precisions", "train.seed": "grid.seeds",
              "preset": "the sweep's top-level preset", **TRIAL_FIELDS}
AxisValue = bool | int | float | str  # one value of an extra grid axis: a scalar, part of the trial key
AXIS_KINDS = get_args(AxisValue)  # bool first: True is an int too
# An axis value as the grid validates it: one error for a value that is no scalar, not one per type.
AxisScalar = one_of("not a scalar: give a string, a number or true/false",
                    *((kind, lambda v, kind=kind: isinstance(v, kind)) for kind in AXIS_KINDS))

# Resources per trial by preset: a GPU is shared by 4 trials; on CPU each trial gets one core.
SWEEP_PRESETS: dict[str, dict[str, float]] = {
    "gpu": {"gpu_per_trial": 0.25, "cpus_per_trial": 1},
    "cpu": {"gpu_per_trial": 0.0, "cpus_per_trial": 1},
}


Item = TypeVar("Item")


def _unique(values: list[Item], what: str) -> list[Item]:
    dupes = sorted({v for v in values if values.count(v) > 1})
    if dupes:
        raise ValueError(f"duplicate {what}(s) {dupes}")
    return values


# The formats of a grid or a search: known names (lower-cased), at least one, no repeats.
Formats = Annotated[list[str], Field(min_length=1),
                    AfterValidator(lambda v: _unique([format_name(f) for f in v], "format"))]

# `all`, or names: one error for anything else, not one per member of the union.
Optimizers = one_of("give 'all' or a list of optimizer names", (Literal["all"], lambda v: v == "all"),
                    (list[str], lambda v: isinstance(v, list)))


def _builtin_precision(name: str) -> str | None:
    """The built-in layer precision `name` names, in any case; None for another name (a policy's)."""
    try:
        return precision_name(name)
    except ValueError:
        return None


def registered_optimizers() -> list[str]:
    from altgrad.optim import OPTIMIZERS

    return sorted(OPTIMIZERS)


class Resources(StrictModel):
    gpu_per_trial: float = Field(ge=0, le=8, description="GPUs per trial; 0.25 = 4 trials share one")
    cpus_per_trial: int = Field(ge=1, description="CPU cores per trial, also torch's thread count")


# Stopper keys that became run settings: each trial's stopper reads them from its own run config.
MOVED_STOPPER_KEYS = {"nan_patience": "base.stability.nan_patience",
                      "stall_threshold": "base.stability.stall_stop",
                      "stall_reports": "base.stability.stall_stop_reports"}


class StopperSettings(StrictModel):
    """The stability stopper: a NaN streak or persistent bit-stall ends a trial early, judged by
    the trial's own `stability` settings (`nan_patience`, `stall_stop`, `stall_stop_reports`), the
    numbers its trainer acts on too. Bit-stall counts only for runs whose weights are stored in
    their format (`quant.master_weights: format`): with fp32 master weights a stalled 8-bit view
    still learns (`train.stability.stall_halts_learning`)."""

    enabled: bool = True

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        moved = [f"stopper.{key} moved to {MOVED_STOPPER_KEYS[key]}" for key in MOVED_STOPPER_KEYS
                 if isinstance(data, dict) and key in data]
        if moved:
            raise ValueError("; ".join(moved) + " (a run setting: the trainer and the stopper read the same "
                             "number, and grid.axes may vary it)")
        return data


class FailureSettings(StrictModel):
    max_failures: int = Field(2, ge=0, description="retries of a crashed trial, from its checkpoint")


class CheckpointSettings(StrictModel):
    num_to_keep: int = Field(
        1, ge=1, description="Tune checkpoints kept per trial (the trainer keeps its own best + last N)"
    )


class WandbSettings(StrictModel):
    enabled: bool = True
    project: str = "altgrad"
    mode: Literal["offline", "online", "disabled"] = "offline"


class DashboardSettings(StrictModel):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(8265, ge=1, le=65535)


class SweepSettings(StrictModel):
    """What every sweep entry point shares: where it lives, the base run and how trials run."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    storage_path: str = "experiments"
    preset: Literal["cpu", "gpu"]
    base: dict[str, Any] = Field(default_factory=dict)
    per_preset: dict[Literal["cpu", "gpu"], dict[str, Any]] = Field(
        default_factory=dict, description="sweep keys layered on the file under that preset only "
                                          "(applied by `load_sweep_config`, like `smoke`)"
    )
    resources: Resources
    max_concurrent_trials: int | None = Field(None, ge=1)
    stopper: StopperSettings = Field(default_factory=StopperSettings)
    failure: FailureSettings = Field(default_factory=FailureSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    wandb: WandbSettings = Field(default_factory=WandbSettings)
    dashboard: DashboardSettings = Field(default_factory=DashboardSettings)
    smoke: dict[str, Any] = Field(default_factory=dict, description="overrides applied by --smoke")

    @field_validator("name")
    @classmethod
    def _names_a_folder_of_its_own(cls, v: str) -> str:
        """`.` and `..` fit the pattern, but name the storage folder or its parent: `--fresh` would
        move that aside, every experiment in it with it."""
        if not v.strip("."):
            raise ValueError(f"{v!r} names the storage path itself or a folder above it, not an experiment "
                             "in it; use a name with a letter or a digit")
        return v

    @field_validator("base")
    @classmethod
    def _no_preset_inside(cls, base: dict[str, Any]) -> dict[str, Any]:
        if "preset" in base:
            raise ValueError("set the sweep's top-level `preset`, not a preset inside the run")
        return base

    @classmethod
    def validated(cls, data: dict[str, Any]) -> Self:
        """The model, with `base` validated as a RunConfig too; ConfigError names the field."""
        try:
            cfg = cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(describe_validation_error(e)) from None
        cfg.base_run  # noqa: B018 - validates base (ConfigError names the field)
        cfg.check()
        return cfg

    def check(self) -> None:
        """Cross-field checks that need the run config; ConfigError names the field."""

    @cached_property
    def base_run(self) -> RunConfig:
        """The run every trial starts from (preset < base), validated once."""
        return self.run_config({})

    def run_config(self, overrides: dict[str, Any]) -> RunConfig:
        """Preset < base < `overrides`, validated as a RunConfig."""
        merged = PRESETS[self.preset]
        for layer in (self.base, overrides):
            merged = deep_merge(merged, layer)
        merged["preset"] = self.preset
        try:
            return RunConfig.model_validate(merged)
        except ValidationError as e:
            raise ConfigError(describe_validation_error(e, prefix="base.")) from None

    def warnings(self) -> list[str]:
        """What is legal but probably not meant; printed before a sweep (and its dry run)."""
        return [w for w in (self.stall_window_warning(), self.checkpointless_warning(), *self.base_warnings()) if w]

    def checkpointless_warning(self) -> str | None:
        """Why an interrupted trial would start over: its first checkpoint is its last step."""
        t = self.base_run.train
        if t.checkpoint_interval < t.max_steps:
            return None
        return (f"base.train.checkpoint_interval ({t.checkpoint_interval}) is not below the trials' {t.max_steps} "
                "steps: a trial saves no checkpoint before its end, so one interrupted starts over (lower "
                "base.train.checkpoint_interval)")

    def fixed_fields(self) -> dict[str, str]:
        """The run settings the sweep sets in every trial itself (dotted path -> the sweep key
        that sets them), whatever `base` says: every sweep's `TRIAL_FIELDS`, and its own."""
        raise NotImplementedError

    def trained_formats(self) -> list[str]:
        """Every format the sweep trains."""
        raise NotImplementedError

    def sets_in_base(self, path: str) -> bool:
        """Whether `base` (with this preset's `per_preset` section) gives the dotted run setting."""
        node: Any = self.base
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    def base_warnings(self) -> list[str]:
        """Settings of `base` that some trials do not use: ones the sweep sets in every trial
        (`fixed_fields`), and stored-in-format weights, which bf16 has none to store in."""
        out = [f"base.{path} is not used: {key} sets it in every trial"
               for path, key in self.fixed_fields().items() if self.sets_in_base(path)]
        if BASELINE in self.trained_formats() and self.base_run.quant.stores_weights_in_format:
            out.append(f"base.quant.master_weights is format, but {BASELINE} has no 8-bit format to store "
                       f"weights in: its trials run with master_weights fp32 (the quantized ones with format)")
        return out

    def stall_window_warning(self) -> str | None:
        """Why the stopper can never stop a trial for bit-stall (its window is longer than the
        bit-stall reports of a whole run), else None. A warning, not an error: the sweep still
        runs, with ASHA and the NaN stopper."""
        if not self.stopper.enabled:
            return None
        run = self.base_run
        available = stall_reports_in_run(run)
        window = run.stability.stall_stop_reports
        if window <= available:
            return None
        t = run.train
        return (f"base.stability.stall_stop_reports ({window}) is more than the {available} reports that "
                f"carry bit-stall in a {t.max_steps}-step run (train.diag_every {t.diag_every}, "
                f"train.log_interval {t.log_interval}), so no trial can be stopped for bit_stall; set "
                f"base.stability.stall_stop_reports to at most {available} or lower base.train.diag_every")

    @property
    def experiment_path(self) -> str:
        return join(self.storage_path, self.name)


class GridSettings(StrictModel):
    formats: Formats
    optimizers: Optimizers = Field(
        "all", description="optimizer names, or 'all' = every registered optimizer"
    )
    precisions: list[str] = Field(default_factory=lambda: ["all"], min_length=1)
    policies: dict[str, list[LayerRule]] = Field(
        default_factory=dict, description="named custom layer-precision policies; `{fmt}` in a rule "
                                          "is the grid point's format")
    seeds: list[int] | None = Field(None, min_length=1, description="default: base train.seed")
    format_overrides: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per format, RunConfig fields on top of base (e.g. its lr)"
    )
    axes: dict[str, list[AxisScalar]] = Field(
        default_factory=dict,
        description="extra grid axes: dotted RunConfig setting -> values, e.g. quant.rounding: "
                    "[nearest, stochastic]; each value is one more trial per cell",
    )

    @field_validator("axes")
    @classmethod
    def _axes(cls, v: dict[str, list[AxisValue]]) -> dict[str, list[AxisValue]]:
        for path, values in v.items():
            if path in FIXED_AXES:
                raise ValueError(f"{path!r} is a fixed axis of the grid: set it with {FIXED_AXES[path]}")
            leaf_field(path)
            if not values:
                raise ValueError(f"{path}: give at least one value")
            if len({json.dumps(x) for x in values}) < len(values):
                raise ValueError(f"{path}: duplicate values {values}")
        return v

    @field_validator("precisions")
    @classmethod
    def _builtin_precisions_canonical(cls, v: list[str]) -> list[str]:
        """`MLP` is the built-in `mlp`, as in a run's quant.precision; a policy's name is kept as written."""
        return [_builtin_precision(p) or p for p in v]

    @field_validator("optimizers")
    @classmethod
    def _optimizers(cls, v: list[str] | str) -> list[str] | str:
        if v == "all":
            return v
        if not v:
            raise ValueError("give at least one optimizer name, or 'all'")
        unknown = [o for o in v if o not in registered_optimizers()]
        if unknown:
            raise ValueError(
                f"unknown optimizer(s) {unknown}; registered: {registered_optimizers()} (or 'all')"
            )
        return _unique(v, "optimizer")

    @model_validator(mode="after")
    def _precisions_are_known(self) -> GridSettings:
        clash = {p for p in self.policies if _builtin_precision(p)}
        if clash:
            raise ValueError(f"policies: {sorted(clash)} would shadow the built-in precisions")
        unknown = [p for p in self.precisions if p not in PRECISION_PRESETS and p not in self.policies]
        if unknown:
            raise ValueError(
                f"precisions: unknown {unknown}; use {list(PRECISION_PRESETS)} or a name defined "
                "under grid.policies"
            )
        _unique(self.precisions, "precision")
        _unique(self.seeds or [], "seed")  # a repeated seed would be the same trial twice
        for fmt, overrides in self.format_overrides.items():  # may name formats outside this grid (--smoke's)
            format_name(fmt)
            # what a format's trials ran with is then what the report says they ran with
            for path in flattened(overrides):
                if path in FIXED_AXES or (fmt == BASELINE and path == "quant.master_weights"):
                    by = FIXED_AXES.get(path, f"{BASELINE} stores no weights in a format")
                    raise ValueError(f"format_overrides.{fmt}: {path!r} is set by the grid ({by})")
                if path in self.axes:
                    raise ValueError(f"format_overrides.{fmt}: {path!r} is also an extra axis (grid.axes), "
                                     "whose values would replace it")
        return self

    @property
    def optimizer_names(self) -> list[str]:
        return registered_optimizers() if self.optimizers == "all" else list(self.optimizers)


def asha_milestones(grace_period: int, reduction_factor: float, max_t: int) -> list[int]:
    """The rungs: grace_period × rf^k below max_t (a rung at the last step could save nothing)."""
    rungs, t = [], float(grace_period)
    while t < max_t:
        rungs.append(int(round(t)))
        t *= reduction_factor
    return rungs


class AshaSettings(StrictModel):
    """Rungs at which a broken trial is stopped (see `altgrad.tune.asha`): never the best-k rule."""

    enabled: bool = True
    metric: str = Field(VAL_LOSS, description="a metric every report carries (metrics.EVERY_REPORT)")
    mode: Literal["min", "max"] = "min"
    grace_period: int = Field(20, ge=1, description="steps before the first rung")
    reduction_factor: float = Field(3.0, gt=1, description="rung spacing: rungs at grace_period × rf^k")
    max_t: int | None = Field(None, ge=1, description="default: base train.max_steps")
    tolerance: float = Field(
        0.10, ge=0, description="stop a trial whose metric trails the rung's reference (bf16 of the "
                                "same optimizer and seed; in a grid without bf16, the rung's best) by "
                                "more than this fraction"
    )

    @field_validator("metric")
    @classmethod
    def _reported_every_time(cls, v: str) -> str:
        if v not in EVERY_REPORT:
            raise ValueError(f"{v!r} is not in every report of a trial; use one of {list(EVERY_REPORT)}")
        return v


# What a trial compiles (`estimate.compile_keys`): its step graphs (`train.compile`), or else a set
# of per-tensor kernels. The stored estimate's costs are per kind.
STEP_GRAPH, KERNEL_SET = "step_graph", "kernel_set"
CompiledUnit = Literal["step_graph", "kernel_set"]
PerUnitSeconds = dict[Literal["cpu", "gpu"], dict[CompiledUnit, float]]  # seconds per preset and kind of unit


class EstimateSettings(StrictModel):
    """`--dry-run`'s time and cost estimate."""

    measure_steps: int = Field(
        12, ge=0, description="steps of a bf16 and the slowest quantized trial (of each model, batch "
        "size, train.compile and eval_iters the grid has) timed on this machine "
        "(at least 6; 12 with diagnostics or the shadow on some steps only), each in a fresh process "
        "compiling into one cache the timed runs share (one that compiles runs twice: cold, then "
        "warm, which times the compiling apart); 0 = use step_time_s")
    # The stored costs below were measured: cpu on this project's 2-core machine, gpu on an H200
    # with four trials sharing it and CUDA graphs on (docs/design.md, "Budgets at the cpu preset"
    # and "GPU runs"). A new measurement replaces them here, for every sweep config at once.
    step_time_s: dict[Literal["cpu", "gpu"], float] = Field(
        default_factory=lambda: {"cpu": 0.25, "gpu": 0.050},
        description="stored seconds per step of one trial, per preset, used when the preset cannot be "
                    "measured here (gpu on a cpu machine) or measure_steps is 0")
    startup_s: PerUnitSeconds = Field(
        default_factory=lambda: {"cpu": {KERNEL_SET: 6.0, STEP_GRAPH: 14.5}, "gpu": {STEP_GRAPH: 49.0}},
        description="stored seconds, per preset and what its trials compile (step_graph: train.compile "
        "on; kernel_set: off), from a trial's start to its first step when that is in the "
        "experiment's compile cache (building the model, loading its compiled code). Used with "
        "step_time_s; a kind with none stored is not counted")
    compile_s: PerUnitSeconds = Field(
        default_factory=lambda: {"cpu": {KERNEL_SET: 18.0, STEP_GRAPH: 32.0}, "gpu": {STEP_GRAPH: 178.0}},
        description="stored seconds, per preset and kind of compiled unit (a step graph, or a set of "
        "per-tensor kernels, which compiles faster), that compiling one takes beyond startup_s, "
        "counted once per distinct one in the grid (estimate.compile_keys): a later trial with the "
        "same one loads it from the experiment's compile cache. Used with step_time_s; a kind with "
        "none stored is not counted")
    trial_overhead_s: float = Field(2.0, ge=0, description="per trial, what Ray adds to its start-up "
                                    "and steps: Tune's bookkeeping, the trial's W&B run, its last "
                                    "report. Tune reuses a trial's worker process for the next, so "
                                    "no process start or imports")
    sweep_overhead_s: float = Field(11.0, ge=0, description="once per sweep: Ray's start, its first "
                                    "workers' imports, the trial table and report at the end")
    usd_per_gpu_hour: float = Field(2.5, ge=0, description="price of one GPU-hour for the cost line")


class SweepConfig(SweepSettings):
    """`sweeps/format_ablation.py`: formats × optimizers × layer precisions × seeds × extra axes."""

    grid: GridSettings
    asha: AshaSettings = Field(default_factory=AshaSettings)
    estimate: EstimateSettings = Field(default_factory=EstimateSettings)

    def fixed_fields(self) -> dict[str, str]:
        """The grid's fixed axes (seeds only when the grid lists them; else base's seed runs)."""
        return {path: key for path, key in FIXED_AXES.items()
                if path != "preset" and (path != "train.seed" or self.grid.seeds)}

    def trained_formats(self) -> list[str]:
        return list(self.grid.formats)

    def warnings(self) -> list[str]:
        rungless = (f"asha.grace_period ({self.asha.grace_period}) is not below the trials' {self.max_t} steps: "
                    "ASHA has no rung and stops no trial (the stability stopper still does)")
        return [*super().warnings(), *(
            f"grid.axes.{path} overrides base.{path} in every trial; the base value is not used"
            for path in self.grid.axes if self.sets_in_base(path)),
            *([rungless] if self.asha.grace_period >= self.max_t else []), *self.rungs_before_evaluating(),
            *self.budgets_past_baseline()]

    def rungs_before_evaluating(self) -> list[str]:
        """ASHA's rungs that come before the first evaluation after step 1: they judge a trial by
        the loss it started from, not by anything it learned."""
        if not self.asha.enabled:
            return []
        every = self.base_run.train.eval_interval
        early = [m for m in asha_milestones(self.asha.grace_period, self.asha.reduction_factor, self.max_t)
                 if m < every]
        return [f"ASHA's rung{'s' * (len(early) > 1)} at step {', '.join(map(str, early))} come{'s' * (len(early) == 1)} "
                f"before the first evaluation after step 1 (train.eval_interval {every}): "
                f"{'they judge' if len(early) > 1 else 'it judges'} each trial by its loss at step 1, not by "
                f"what it learned (set asha.grace_period to at least {every})"] if early else []

    def budgets_past_baseline(self) -> list[str]:
        """Formats given more steps than bf16 (`grid.format_overrides`): no bf16 seed is evaluated
        at their budget, so the report compares them with nothing."""
        if BASELINE not in self.grid.formats:
            return []
        def steps(fmt: str) -> int:
            return self.run_config(self.grid.format_overrides.get(fmt, {})).train.max_steps
        baseline = steps(BASELINE)
        return [f"grid.format_overrides.{fmt} trains {n} steps, past {BASELINE}'s {baseline}: no {BASELINE} seed "
                f"is evaluated at its budget, so the report compares {fmt} with nothing (give {BASELINE} the "
                f"same train.max_steps)"
                for fmt in self.grid.formats if fmt in self.grid.format_overrides and (n := steps(fmt)) > baseline]

    def check(self) -> None:
        """Every extra-axis value must validate in the run config, named by its field, and no two
        may be the same setting once validated (`1e-2`, a string to YAML, is the float 0.01)."""
        for path, values in self.grid.axes.items():
            settings: list[tuple[Any, Any]] = []
            for value in values:
                try:
                    run = self.run_config(nested(path, value))
                except ConfigError as e:
                    raise ConfigError(f"grid.axes.{path}: value {value!r} is not valid:\n{e}") from None
                setting = reduce(getattr, path.split("."), run)
                for earlier, its in settings:
                    if its == setting:
                        raise ConfigError(f"grid.axes.{path}: values {earlier!r} and {value!r} are the same "
                                          f"setting ({setting!r}); give each once")
                settings.append((value, setting))

    @property
    def max_t(self) -> int:
        return self.asha.max_t or self.base_run.train.max_steps


class LrRange(StrictModel):
    grid: Annotated[list[float], AfterValidator(lambda v: _unique(v, "learning rate"))] = Field(
        min_length=1, description="learning rates tried first, per format")
    low: float = Field(gt=0)
    high: float = Field(gt=0)
    samples: int = Field(4, ge=0, description="Optuna samples per format after the grid")

    @model_validator(mode="after")
    def _ordered(self) -> LrRange:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        outside = [x for x in self.grid if not self.low <= x <= self.high]
        if outside:
            raise ValueError(f"grid values {outside} lie outside [low, high]")
        return self


class LrSearchConfig(SweepSettings):
    """`sweeps/lr_search.py`: per format, the largest learning rate that still trains stably."""

    formats: Formats
    optimizer: str = "adamw"
    precision: str = "all"
    lr: LrRange
    tolerance: float = Field(
        0.0, ge=0, lt=1, description="stable = final val loss < first val loss × (1 - tolerance), no stop"
    )

    def fixed_fields(self) -> dict[str, str]:
        """Format, optimizer and precision per experiment; the learning rate is what it searches."""
        return {"quant.format": "formats", "optim.name": "optimizer", "quant.precision": "precision",
                "optim.lr": "the search over lr", **TRIAL_FIELDS}

    def trained_formats(self) -> list[str]:
        return list(self.formats)

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, v: str) -> str:
        if v not in registered_optimizers():
            raise ValueError(f"unknown optimizer {v!r}; registered: {registered_optimizers()}")
        return v

    @field_validator("precision")
    @classmethod
    def _precision(cls, v: str) -> str:
        return precision_name(v)


Settings = TypeVar("Settings", bound=SweepSettings)


def load_sweep_config(
    model: type[Settings],
    path: str | Path,
    overrides: list[str] | None = None,
    smoke: bool = False,
    name: str | None = None,
    storage_path: str | None = None,
) -> Settings:
    """Read, layer and validate a sweep YAML; ConfigError (naming the field) on any problem."""
    data = read_yaml(path)
    overridden = apply_overrides(data, overrides or [])  # --set may name the preset and its section
    preset = resolve_preset(overridden.get("preset"))
    per_preset = overridden.get("per_preset") or {}
    if not isinstance(per_preset, dict) or not all(isinstance(v, dict) for v in per_preset.values()):
        raise ConfigError("per_preset: expected {cpu: {...}, gpu: {...}} mappings of sweep keys")

    def layered(preset: str, document: dict[str, Any], sets: list[str], with_smoke: bool = smoke,
                with_section: bool = True) -> dict[str, Any]:
        # from the overridden document, so that `--set smoke.x=…` (or `per_preset.cpu.x=…`) is
        # layered where its section is; `--set` then comes last again
        out = deep_merge(document, (per_preset.get(preset) or {}) if with_section else {})
        if with_smoke:
            section = out.get("smoke") or {}
            if not isinstance(section, dict):
                raise ConfigError("smoke: expected a mapping of overrides")
            out = deep_merge(out, section)
            if "name" not in section and "name" in out:
                out["name"] = f"{out['name']}-smoke"
        out = apply_overrides(out, sets)
        if name is not None:
            out["name"] = name
        if storage_path is not None:
            out["storage_path"] = storage_path
        out["preset"] = preset
        resources = out.get("resources") or {}
        if isinstance(resources, dict):
            out["resources"] = {**SWEEP_PRESETS[preset], **resources}
        if isinstance(out.get("storage_path"), str) and not is_remote(out["storage_path"]):
            out["storage_path"] = str(Path(out["storage_path"]).expanduser().resolve())
        if isinstance(base := out.get("base", {}), dict):
            out["base"] = absolute_data_paths(base)
        return out

    def valid(document: dict[str, Any]) -> bool:
        try:
            model.validated(document)
        except ConfigError:
            return False
        return True

    # A typo in another preset's section, or in the smoke section of a run without --smoke, fails
    # here too. Those are checked on the file as written (with `--set per_preset.<it>.…` or
    # `smoke.…`), not with this run's other `--set`s: those are meant for this run
    # (`base.train.max_steps=40` is no error because the gpu preset warms up 100).
    written = {**data, "per_preset": per_preset, **{k: overridden[k] for k in ("smoke",) if k in overridden}}
    for other in set(per_preset) - {preset}:
        if other not in PRESETS:
            raise ConfigError(f"per_preset.{other}: unknown preset; choose from {sorted(PRESETS)}")
        as_written = layered(other, written, [], with_smoke=False)
        if valid(as_written) or valid(layered(other, overridden, overrides or [], with_smoke=False)):
            continue  # (a `--set` may complete what the file leaves to it, e.g. an lr search's `lr`)
        try:
            model.validated(as_written)
        except ConfigError as e:
            raise ConfigError(f"under preset {other} (with per_preset.{other}): {e}") from None
    if not smoke and written.get("smoke"):
        try:
            model.validated(layered(preset, written, [], with_smoke=True))
        except ConfigError as e:
            if valid(layered(preset, written, [])):
                raise ConfigError(f"with --smoke (the smoke: section): {e}") from None
    try:
        return model.validated(layered(preset, overridden, overrides or []))
    except ConfigError as e:  # say which section of the file it came from, where one did
        if smoke and valid(layered(preset, overridden, overrides or [], with_smoke=False)):
            raise ConfigError(f"with --smoke (the smoke: section): {e}") from None
        if per_preset.get(preset) and valid(layered(preset, overridden, overrides or [], with_section=False)):
            raise ConfigError(f"with per_preset.{preset}: {e}") from None
        raise


def absolute_data_paths(run: dict[str, Any], base: Path | None = None) -> dict[str, Any]:
    """`run` (a run config, or a sweep's `base`: part of one) with its data paths absolute, those it
    leaves at their defaults included; relative ones are resolved against `base` (default: the
    current directory, where a config is loaded). Trials run in their own working directory, and a
    sweep's stored config (its `base`, resolved where the sweep was created) must name the same data
    when it is resumed from another one. What is not a path (`hf`, a wrong type) is left to
    validation."""
    data = run.get("data", {})
    if not isinstance(data, dict):
        return run
    defaults = DataConfig()
    data = {"source": defaults.source, "data_root": defaults.data_root, **data}
    source, root = data["source"], data["data_root"]

    def absolute(path: str) -> str:
        return str(((base or Path.cwd()) / Path(path).expanduser()).resolve())

    if isinstance(source, str) and source.startswith("jsonl:") and (folder := source.removeprefix("jsonl:")):
        data["source"] = "jsonl:" + absolute(folder)
    if isinstance(root, str):
        data["data_root"] = absolute(root)
    return {**run, "data": data}
