"""Sweep configuration: one pydantic model per entry point, validated whole before Ray starts.

Layering, lowest priority first: the sweep preset (`cpu` / `gpu`, auto from CUDA) < the YAML file
< its `smoke:` section (with `--smoke`) < `--set key=value`. `base` is a RunConfig-shaped mapping
shared by every trial; it is validated here through `RunConfig` (errors say `base.optim.lr: ...`),
and every grid point is validated when the grid is built, so nothing is written before a typo is
caught.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from altgrad.config import (
    BASELINE,
    PRECISION_PRESETS,
    PRESETS,
    ConfigError,
    RunConfig,
    apply_overrides,
    deep_merge,
    describe_validation_error,
    read_yaml,
    resolve_preset,
)
from altgrad.tune.trial_spec import stall_reports_in_run

FORMAT_PLACEHOLDER = "{fmt}"  # in a custom policy rule: the grid point's format

# Resources per trial by preset: a GPU is shared by 4 trials; on CPU each trial gets one core.
SWEEP_PRESETS: dict[str, dict[str, float]] = {
    "gpu": {"gpu_per_trial": 0.25, "cpus_per_trial": 1},
    "cpu": {"gpu_per_trial": 0.0, "cpus_per_trial": 1},
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def known_format(name: str) -> str:
    """A grid format: a name from `altgrad.quant.FORMATS`, or the `bf16` baseline."""
    from altgrad.quant import FORMATS

    name = name.lower()
    if name != BASELINE and name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; choose from {[BASELINE, *sorted(FORMATS)]}")
    return name


def _unique(values: list[str], what: str) -> list[str]:
    dupes = sorted({v for v in values if values.count(v) > 1})
    if dupes:
        raise ValueError(f"duplicate {what}(s) {dupes}")
    return values


# The formats of a grid or a search: known names (lower-cased), at least one, no repeats.
Formats = Annotated[list[str], Field(min_length=1),
                    AfterValidator(lambda v: _unique([known_format(f) for f in v], "format"))]


def registered_optimizers() -> list[str]:
    from altgrad.optim import OPTIMIZERS

    return sorted(OPTIMIZERS)


class Resources(_Strict):
    gpu_per_trial: float = Field(ge=0, le=8, description="GPUs per trial; 0.25 = 4 trials share one")
    cpus_per_trial: int = Field(ge=1, description="CPU cores per trial, also torch's thread count")


class StopperSettings(_Strict):
    """The stability stopper: NaN streaks and persistent bit-stall end a trial early."""

    enabled: bool = True
    nan_patience: int = Field(5, ge=1, description="stop after this many consecutive NaN steps")
    stall_threshold: float = Field(0.99, gt=0, le=1, description="bit-stall rate that counts as stalled")
    stall_reports: int = Field(
        20, ge=1, description="stop after this many stalled reports in a row; only reports of "
                              "diagnostic steps (train.diag_every) carry bit-stall and count"
    )


class FailureSettings(_Strict):
    max_failures: int = Field(2, ge=0, description="retries of a crashed trial, from its checkpoint")


class CheckpointSettings(_Strict):
    num_to_keep: int = Field(
        1, ge=1, description="Tune checkpoints kept per trial (the trainer keeps its own best + last N)"
    )


class WandbSettings(_Strict):
    enabled: bool = True
    project: str = "altgrad"
    mode: Literal["offline", "online", "disabled"] = "offline"


class DashboardSettings(_Strict):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(8265, ge=1, le=65535)


class SweepSettings(_Strict):
    """What every sweep entry point shares: where it lives, the base run and how trials run."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    storage_path: str = "experiments"
    preset: Literal["cpu", "gpu"]
    base: dict[str, Any] = Field(default_factory=dict)
    base_per_preset: dict[Literal["cpu", "gpu"], dict[str, Any]] = Field(
        default_factory=dict, description="added to base under that preset only"
    )
    resources: Resources
    max_concurrent_trials: int | None = Field(None, ge=1)
    stopper: StopperSettings = Field(default_factory=StopperSettings)
    failure: FailureSettings = Field(default_factory=FailureSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    wandb: WandbSettings = Field(default_factory=WandbSettings)
    dashboard: DashboardSettings = Field(default_factory=DashboardSettings)
    smoke: dict[str, Any] = Field(default_factory=dict, description="overrides applied by --smoke")

    @field_validator("base")
    @classmethod
    def _no_preset_inside(cls, base: dict[str, Any]) -> dict[str, Any]:
        if "preset" in base:
            raise ValueError("set the sweep's top-level `preset`, not a preset inside the run")
        return base

    @field_validator("base_per_preset")
    @classmethod
    def _no_nested_preset(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for section in v.values():
            cls._no_preset_inside(section)
        return v

    @classmethod
    def validated(cls, data: dict[str, Any]) -> Self:
        """The model, with `base` validated as a RunConfig too (under every preset it names, so a
        gpu section fails on a cpu machine already); ConfigError names the field."""
        try:
            cfg = cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(describe_validation_error(e)) from None
        cfg.run_config({})
        for preset in set(cfg.base_per_preset) - {cfg.preset}:
            try:
                cfg.model_copy(update={"preset": preset}).run_config({})
            except ConfigError as e:
                raise ConfigError(f"under preset {preset} (base + base_per_preset.{preset}): {e}") from None
        return cfg

    def run_config(self, overrides: dict[str, Any]) -> RunConfig:
        """Preset < base < base_per_preset[preset] < `overrides`, validated as a RunConfig."""
        merged = PRESETS[self.preset]
        for layer in (self.base, self.base_per_preset.get(self.preset, {}), overrides):
            merged = deep_merge(merged, layer)
        merged["preset"] = self.preset
        try:
            return RunConfig.model_validate(merged)
        except ValidationError as e:
            raise ConfigError(describe_validation_error(e, prefix="base.")) from None

    def stall_window_warning(self) -> str | None:
        """Why the stopper can never stop a trial for bit-stall (its window is longer than the
        bit-stall reports of a whole run), else None. A warning, not an error: the sweep still
        runs, with ASHA and the NaN stopper."""
        if not self.stopper.enabled:
            return None
        run = self.run_config({})
        available = stall_reports_in_run(run)
        if self.stopper.stall_reports <= available:
            return None
        t = run.train
        return (f"stopper.stall_reports ({self.stopper.stall_reports}) is more than the {available} "
                f"reports that carry bit-stall in a {t.max_steps}-step run (train.diag_every "
                f"{t.diag_every}, train.log_interval {t.log_interval}), so no trial can be stopped for "
                f"bit_stall; set stopper.stall_reports to at most {available} or lower base.train.diag_every")

    @property
    def experiment_path(self) -> str:
        return f"{self.storage_path.rstrip('/')}/{self.name}"


class PolicyRule(_Strict):
    """One rule of a named custom layer-precision policy; `{fmt}` stands for the grid's format."""

    pattern: str
    format: str

    @field_validator("format")
    @classmethod
    def _format(cls, v: str) -> str:
        return v if v == FORMAT_PLACEHOLDER else known_format(v)


class GridSettings(_Strict):
    formats: Formats
    optimizers: list[str] | Literal["all"] = Field(
        "all", description="optimizer names, or 'all' = every registered optimizer"
    )
    precisions: list[str] = Field(default_factory=lambda: ["all"], min_length=1)
    policies: dict[str, list[PolicyRule]] = Field(default_factory=dict)
    seeds: list[int] | None = Field(None, min_length=1, description="default: base train.seed")
    format_overrides: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per format, RunConfig fields on top of base (e.g. its lr)"
    )

    @field_validator("optimizers")
    @classmethod
    def _optimizers(cls, v: list[str] | str) -> list[str] | str:
        if v == "all":
            return v
        unknown = [o for o in v if o not in registered_optimizers()]
        if unknown:
            raise ValueError(
                f"unknown optimizer(s) {unknown}; registered: {registered_optimizers()} (or 'all')"
            )
        return _unique(v, "optimizer")

    @model_validator(mode="after")
    def _precisions_are_known(self) -> GridSettings:
        clash = set(self.policies) & set(PRECISION_PRESETS)
        if clash:
            raise ValueError(f"policies: {sorted(clash)} would shadow the built-in precisions")
        unknown = [p for p in self.precisions if p not in PRECISION_PRESETS and p not in self.policies]
        if unknown:
            raise ValueError(
                f"precisions: unknown {unknown}; use {list(PRECISION_PRESETS)} or a name defined "
                "under grid.policies"
            )
        _unique(self.precisions, "precision")
        for fmt in self.format_overrides:  # may name formats outside this grid (e.g. --smoke's)
            known_format(fmt)
        return self

    @property
    def optimizer_names(self) -> list[str]:
        return registered_optimizers() if self.optimizers == "all" else list(self.optimizers)


class AshaSettings(_Strict):
    enabled: bool = True
    metric: str = "val/loss"
    mode: Literal["min", "max"] = "min"
    grace_period: int = Field(20, ge=1, description="steps before the first rung")
    reduction_factor: float = Field(3.0, gt=1)
    max_t: int | None = Field(None, ge=1, description="default: base train.max_steps")


class SweepConfig(SweepSettings):
    """`sweeps/format_ablation.py`: the format × optimizer × layer-precision grid under ASHA."""

    grid: GridSettings
    asha: AshaSettings = Field(default_factory=AshaSettings)

    @property
    def max_t(self) -> int:
        return self.asha.max_t or self.run_config({}).train.max_steps


class LrRange(_Strict):
    grid: list[float] = Field(min_length=1, description="learning rates tried first, per format")
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
        0.0, ge=0, description="stable = final val loss < first val loss × (1 - tolerance), no stop"
    )

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, v: str) -> str:
        if v not in registered_optimizers():
            raise ValueError(f"unknown optimizer {v!r}; registered: {registered_optimizers()}")
        return v

    @field_validator("precision")
    @classmethod
    def _precision(cls, v: str) -> str:
        if v not in PRECISION_PRESETS:
            raise ValueError(f"unknown precision {v!r}; use one of {list(PRECISION_PRESETS)}")
        return v


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
    if smoke:
        section = data.get("smoke") or {}
        if not isinstance(section, dict):
            raise ConfigError("smoke: expected a mapping of overrides")
        data = deep_merge(data, section)
        if "name" not in section and "name" in data:
            data["name"] = f"{data['name']}-smoke"
    data = apply_overrides(data, overrides or [])
    if name is not None:
        data["name"] = name
    if storage_path is not None:
        data["storage_path"] = storage_path
    preset = resolve_preset(data.get("preset"))
    data["preset"] = preset
    resources = data.get("resources") or {}
    if isinstance(resources, dict):
        data["resources"] = {**SWEEP_PRESETS[preset], **resources}
    if isinstance(data.get("storage_path"), str) and "://" not in data["storage_path"]:
        data["storage_path"] = str(Path(data["storage_path"]).expanduser().resolve())
    return model.validated(data)


def absolute_data_paths(run: dict[str, Any]) -> dict[str, Any]:
    """Trials run in their own working directory: make the run's data paths absolute."""
    data = dict(run["data"])
    if data["source"].startswith("jsonl:"):
        data["source"] = "jsonl:" + str(Path(data["source"].removeprefix("jsonl:")).expanduser().resolve())
    data["data_root"] = str(Path(data["data_root"]).expanduser().resolve())
    return {**run, "data": data}
