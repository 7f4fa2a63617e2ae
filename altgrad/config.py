"""Validated run configuration: pydantic models loaded from YAML, presets, `--set` overrides.

A run is fully described by one `RunConfig`. Layering, lowest to highest priority:
preset (`cpu` / `gpu`, SPEC §9) < YAML file < `--set key=value` overrides. Validation happens once,
up front, so a typo fails before any data is prepared or any directory is written.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from altgrad.precision import BASELINE, FORMAT_PLACEHOLDER, GRAD_FORMAT, PRECISION_PRESETS
from altgrad.scaling_policy import AmaxAlgo, ScalingMode, ScalingPolicy


class ConfigError(ValueError):
    """A user-caused configuration problem; the message names the field and the fix."""


class StrictModel(BaseModel):
    """Every config section: an unknown key is an error (a typo never passes silently), so is a
    boolean where a number belongs (pydantic would take `max_steps: true` as 1), so is an infinite
    or NaN number (`gt=0` lets `lr: .inf` through, and no setting means to be infinite), values are
    frozen once validated, and defaults are validated like given values. Otherwise values convert as
    pydantic's lax mode does: YAML 1.1 reads `6e-4` as a string, which must still be a float."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            kinds = get_args(annotation) or (annotation,)
            if bool not in kinds and any(kind in (int, float) for kind in kinds):
                raise ValueError(f"a number, not {str(value).lower()}")
        return value


def format_name(name: str) -> str:
    """The canonical name of a format (`E4M3` -> `e4m3`) or `bf16`; ValueError listing the choices.
    Every config field that names a format is validated by this one function."""
    # Imported here: the package `altgrad.quant` loads torch, which reading a config must not.
    from altgrad.quant.formats import FORMATS, get_format

    if name.strip().lower() == BASELINE:
        return BASELINE
    try:
        return get_format(name).name
    except ValueError as e:
        raise ValueError(f"unknown format {name!r} ({e}); choose from {[BASELINE, *sorted(FORMATS)]}") from None


def precision_name(name: str) -> str:
    """The canonical name of a built-in layer precision (`MLP` -> `mlp`: case-insensitive, as format
    names are); ValueError listing the choices."""
    canonical = name.strip().lower()
    if canonical not in PRECISION_PRESETS:
        raise ValueError(f"unknown precision {name!r}; use one of {list(PRECISION_PRESETS)} or a list of "
                         "{pattern, format} rules")
    return canonical


ONE_OF_MEMBER = "member-"  # how `one_of` tags its members; `describe_validation_error` omits them


def one_of(expected: str, *members: tuple[Any, Callable[[Any], bool]]) -> Any:
    """A union type validated as its first `(type, test)` member whose test the value passes: a
    wrong value is one error (`expected`, or the chosen member's own), where pydantic's union
    reports one per member (`quant.precision=5` read 'not a valid string' and 'not a valid list')."""
    def member(value: Any) -> str | None:
        return next((f"{ONE_OF_MEMBER}{i}" for i, (_, test) in enumerate(members) if test(value)), None)

    tagged = tuple(Annotated[kind, Tag(f"{ONE_OF_MEMBER}{i}")] for i, (kind, _) in enumerate(members))
    return Annotated[Union[tagged], Discriminator(member, custom_error_type="one_of",  # noqa: UP007
                                                  custom_error_message=expected)]


class ModelConfig(StrictModel):
    """Validated fields of `altgrad.model.GPTConfig` (same names; the trainer builds one from them)."""

    n_layer: int = Field(6, ge=1)
    n_head: int = Field(6, ge=1)
    n_embd: int = Field(384, ge=8)
    block_size: int = Field(256, ge=2)
    vocab_size: int = Field(50304, ge=50257, description="GPT-2 BPE, padded to a multiple of 64")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    bias: bool = False

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self


class DataConfig(StrictModel):
    source: str = "jsonl:../shared/data/eurlex"
    name: str | None = None
    max_docs: int | None = Field(None, ge=1)
    data_root: str = "data"
    val_split: str = "validation"

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        if v != "hf" and not (v.startswith("jsonl:") and len(v) > len("jsonl:")):
            raise ValueError("source must be 'hf' or 'jsonl:DIR' (a folder with train/validation .jsonl files)")
        return v


class ScalingConfig(StrictModel):
    """Per-tensor scaling of a quantized tensor (SPEC §2): `none` is the format's raw range. The
    YAML form of `ScalingPolicy`, whose allowed values and defaults it takes."""

    mode: ScalingMode = ScalingPolicy.mode
    history_len: int = ScalingPolicy.history_len
    algo: AmaxAlgo = ScalingPolicy.algo
    margin: int = ScalingPolicy.margin
    pow2: bool = ScalingPolicy.pow2

    @model_validator(mode="after")
    def _valid_policy(self) -> ScalingConfig:
        self.policy()  # ScalingPolicy's own checks (history_len >= 1), as a config error
        return self

    def policy(self) -> ScalingPolicy:
        return ScalingPolicy(**self.model_dump())


class LayerRule(StrictModel):
    """One rule of a custom layer-precision policy (`altgrad.precision`): layers whose name matches
    `pattern` get `format`: a format, `bf16` (kept in high precision) or `{fmt}` (the run's format)."""

    pattern: str
    format: str

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        return v if v == FORMAT_PLACEHOLDER else format_name(v)


def _fields_of(section: Any) -> dict[str, Any] | None:
    """The fields given for a config section (None or absent: none), or None when it is no mapping."""
    if section is None:
        return {}
    if isinstance(section, BaseModel):
        return section.model_dump(exclude_unset=True)
    return dict(section) if isinstance(section, dict) else None


class RolesConfig(StrictModel):
    """Which of a quantized layer's tensors are fake-quantized. A role switched off passes its tensor
    through untouched (no scaling state, no counters): `grad_output: false` is forward-only
    quantization with full-precision gradients, an ablation of what the gradient format costs."""

    input: bool = True
    weight: bool = True
    grad_output: bool = True

    @property
    def enabled(self) -> tuple[str, ...]:
        """The roles switched on, in `altgrad.quant.linear.ROLES` order."""
        return tuple(role for role in type(self).model_fields if getattr(self, role))


# A built-in layer precision's name, or custom rules.
Precision = one_of(f"not a layer precision: give one of {list(PRECISION_PRESETS)} or a list of "
                   "{pattern, format} rules",
                   (str, lambda v: isinstance(v, str)), (list[LayerRule], lambda v: isinstance(v, list)))


class QuantConfig(StrictModel):
    format: str = "e4m3"
    precision: Precision = "all"
    grad_format: str = GRAD_FORMAT
    roles: RolesConfig = Field(default_factory=RolesConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    grad_scaling: ScalingConfig = Field(
        default_factory=ScalingConfig, description="scaling of grad_output alone; a field not set "
        "here is taken from `scaling`. The literature reports that 4-exponent-bit gradients without "
        "per-tensor scaling (mode none) fail while e5m2 survives: this tests it without changing how "
        "activations and weights are scaled")
    rounding: Literal["nearest", "stochastic"] = "nearest"
    clip_ste: bool = False
    master_weights: Literal["fp32", "format"] = "fp32"
    weight_rounding: Literal["nearest", "stochastic"] = "nearest"

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        return format_name(v)

    @field_validator("precision", mode="before")
    @classmethod
    def _known_precision(cls, v: Any) -> Any:
        """A name is made canonical (and an unknown one refused) before the value is validated
        as a name or as rules (`Precision`)."""
        return precision_name(v) if isinstance(v, str) else v

    @field_validator("grad_format")
    @classmethod
    def _known_grad_format(cls, v: str) -> str:
        if format_name(v) == BASELINE:
            raise ValueError(f"{BASELINE} is not an 8-bit format; to keep gradients unquantized switch "
                             "roles.grad_output off")
        return format_name(v)

    @property
    def is_baseline(self) -> bool:
        return self.format == BASELINE

    @property
    def stores_weights_in_format(self) -> bool:
        """The weights are the format's values, re-quantized after every update (no fp32 copy)."""
        return self.master_weights == "format"

    @model_validator(mode="before")
    @classmethod
    def _grad_scaling_inherits_scaling(cls, data: Any) -> Any:
        """Fill grad_scaling's unset fields from scaling, so `scaling.mode=none` alone still scales
        every role alike and `grad_scaling.mode=none` alone keeps the rest of `scaling`."""
        if not isinstance(data, dict):
            return data
        scaling, grad = (_fields_of(data.get(key)) for key in ("scaling", "grad_scaling"))
        if scaling is None or grad is None:
            return data  # not a mapping: left for field validation to report
        return {**data, "grad_scaling": {**scaling, **grad}}

    @model_validator(mode="after")
    def _format_mode_needs_a_format(self) -> QuantConfig:
        if self.stores_weights_in_format and self.is_baseline:
            raise ValueError(
                "master_weights='format' stores weights in an 8-bit format; the bf16 baseline has "
                "none. Use master_weights='fp32' or pick a format"
            )
        if self.stores_weights_in_format and not self.roles.weight:
            raise ValueError(
                "master_weights='format' stores weights in the weight role's format, but roles.weight "
                "is off. Switch roles.weight on or use master_weights='fp32'"
            )
        return self

    @model_validator(mode="after")
    def _some_role_is_quantized(self) -> QuantConfig:
        if not self.is_baseline and not self.roles.enabled:
            raise ValueError(
                f"roles: every role is off, so format {self.format!r} would quantize nothing. Switch "
                f"on at least one of {list(RolesConfig.model_fields)}, or use format={BASELINE!r} "
                "for the unquantized baseline"
            )
        return self


class OptimConfig(StrictModel):
    name: str = "adamw"
    lr: float = Field(6e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)
    lr_ulp: float = Field(1.0, gt=0, description="manifold: ULPs moved per unit Adam direction at peak lr")
    lr_ulp_schedule: Literal["follow_lr", "constant"] = Field(
        "follow_lr", description="manifold: the ULP step follows the lr's warmup and cosine decay, or "
        "stays lr_ulp (SPEC §6's Δw = −lr_ulp·S(w)·adam_direction; format-mode weights keep moving late in "
        "a run instead of stalling once the decayed step is under half an ULP)")
    partition_clip_k: float | None = Field(None, gt=0)

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        from altgrad.optim import OPTIMIZERS

        if v not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {v!r}; choose one of {sorted(OPTIMIZERS)}")
        return v


class TrainConfig(StrictModel):
    max_steps: int = Field(2000, ge=1)
    warmup_steps: int = Field(100, ge=0)
    batch_size: int = Field(12, ge=1)
    seed: int = 42
    log_interval: int = Field(1, ge=1)
    eval_interval: int = Field(50, ge=1)
    eval_iters: int = Field(
        20, ge=1, description="the validation set: eval_iters batches of batch_size windows of "
        "block_size tokens, non-overlapping and spread evenly over the val split, the same for every "
        "seed (altgrad.data.TokenBatches.val_windows). Its size sets the val loss's sampling error: "
        "see docs/design.md")
    checkpoint_interval: int = Field(100, ge=1)
    keep_last: int = Field(2, ge=1)
    shadow_every: int = Field(10, ge=0, description="FP32 shadow comparison every N steps; 0 = off")
    diag_every: int = Field(1, ge=0, description="quant/grad/activation diagnostics every N steps; 0 = off")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(
        None, ge=1, description="CPU threads torch computes with. A CPU run's numbers depend on it: a "
        "reduction or matrix product split over another number of threads sums in another order, and "
        "the run drifts from there (docs/design.md). null: the process's count when the run starts "
        "(a sweep trial's: its CPUs), which the run's config.yaml then records, so that a resume or a "
        "re-run of that config computes with the same")
    autocast: bool = Field(
        True, description="bf16 autocast for what a run does not quantize (the bf16 baseline's "
        "whole model; every run's attention, norms, softmax and loss), on CUDA only: on the CPU those "
        "compute in fp32, and summary.json's `autocast` says which a run did")
    compile: bool = Field(
        True, description="the model's forward and backward as one compiled graph per step, the "
        "quantizer kernels lowered by inductor and every other op its ATen kernel, called from one "
        "wrapper, C++ on the CPU (altgrad.quant.kernels.StepGraph): bit-identical to eager, with "
        "one call a step instead of one per quantized tensor. false: the eager model calling each "
        "kernel on its own (for debugging; ALTGRAD_NO_COMPILE=1 makes everything eager)")
    cuda_graphs: bool = Field(
        True, description="on CUDA, each compiled step graph (forward and backward) is recorded as "
        "CUDA graphs at its second call and replayed after (inductor's cudagraph trees), and so are "
        "a diagnostic step's calls after the backward and after the update and its bit tracking, "
        "once the tensors they read stay put (altgrad.train.replay): the host launches a few graphs "
        "instead of every kernel, whose launches are what bounds a small model's step on a GPU. "
        "Bit-identical to eager (tests/test_cuda.py). Ignored on the CPU, with compile off and "
        "with ALTGRAD_NO_COMPILE=1")


class StabilityConfig(StrictModel):
    """The thresholds that act on a run's metrics (`altgrad.metrics`), one set per run: its trainer
    acts on them, a sweep's stopper judges each trial by its own, and the report reads each run's
    from its config.yaml. Bit-stall has three levels on purpose, one per action, a ladder: a warning
    event at `stall_warn`; an emergency mantissa shift of a layer stalled above
    `shift_stall_threshold` for `shift_patience` diagnostic steps; and a sweep's stop of a run whose
    model-wide rate stays at or above `stall_stop` for `stall_stop_reports` reports. The last two act
    only where stall halts learning, weights stored in their format (`quant.master_weights: format`):
    an fp32 master keeps what its 8-bit view rounds away."""

    nan_patience: int = Field(10, ge=1, description="stop after this many non-finite steps in a row "
                                                    "(the trainer, and a sweep's stopper at the same step)")
    stall_warn: float = Field(0.5, ge=0, le=1)
    overflow_warn: float = Field(0.01, ge=0, le=1)
    underflow_warn: float = Field(0.01, ge=0, le=1)
    kurtosis_warn: float = Field(10.0, gt=0)
    divergence_patience: int = Field(5, ge=1)
    shift_patience: int | None = Field(None, ge=1, description="mantissa shift after N bad steps: a NaN "
                                       "streak, or (weights stored in their format) a layer's bit-stall "
                                       "above shift_stall_threshold on N diagnostic steps; None = off")
    shift_stall_threshold: float = Field(0.9, gt=0, le=1)
    stall_stop: float = Field(0.99, gt=0, le=1, description="a sweep stops a run whose bit-stall rate "
                              "stays at or above this (only a run whose weights are stored in their "
                              "format: with fp32 master weights a stalled 8-bit view still learns)")
    stall_stop_reports: int = Field(
        20, ge=1, description="... for this many reports in a row; only reports of diagnostic steps "
                              "(train.diag_every) carry bit-stall and count")
    dead_grad_signal: float = Field(0.5, ge=0, le=1, description="the report's failure analysis: a "
                                    "dead-gradient fraction (mean over layers) above this points at "
                                    "the backward pass")
    zero_update_signal: float = Field(0.5, ge=0, le=1, description="the report's failure analysis: a "
                                      "zero-update fraction above this points at the optimizer")


class RunConfig(StrictModel):
    preset: Literal["cpu", "gpu"] | None = None
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    quant: QuantConfig = Field(default_factory=QuantConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    stability: StabilityConfig = Field(default_factory=StabilityConfig)

    @model_validator(mode="after")
    def _manifold_needs_quantized_weights(self) -> RunConfig:
        if self.optim.name == "manifold" and not self.quant.is_baseline and not self.quant.roles.weight:
            raise ValueError("optim.name=manifold steps weights in ULPs of their format: it needs "
                             "quant.roles.weight on (or use adamw)")
        return self

    @model_validator(mode="after")
    def _schedule_fits(self) -> RunConfig:
        if self.train.warmup_steps >= self.train.max_steps:
            raise ValueError(
                f"train.warmup_steps ({self.train.warmup_steps}) must be below train.max_steps "
                f"({self.train.max_steps})"
            )
        return self


PRESETS: dict[str, dict[str, Any]] = {
    # The research plan's model (SPEC §9).
    "gpu": {
        "model": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256},
        "optim": {"lr": 6e-4, "grad_clip": 1.0},
        "train": {"batch_size": 12, "max_steps": 2000, "warmup_steps": 100, "seed": 42,
                  "eval_interval": 50, "eval_iters": 20, "checkpoint_interval": 100,
                  "shadow_every": 10},
    },
    # Small enough that the full grid finishes in minutes on 2 cores. Why it evaluates every 20 steps
    # and does not compile: docs/design.md, "Validation loss" and "The whole step in one graph".
    "cpu": {
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
        "optim": {"lr": 2e-3, "grad_clip": 1.0},
        "train": {"batch_size": 8, "max_steps": 60, "warmup_steps": 6, "seed": 42,
                  "eval_interval": 20, "eval_iters": 16, "checkpoint_interval": 20,
                  "shadow_every": 10, "device": "cpu", "autocast": False, "compile": False},
        "data": {"max_docs": 200},
    },
}


def leaf_field(path: str) -> str:
    """Check that `path` (e.g. `quant.scaling.mode`) names a setting of `RunConfig`, not a section;
    returns it unchanged, else ValueError saying what is there."""
    model: type[BaseModel] = RunConfig
    parts = path.split(".")
    for i, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            where = ".".join(parts[:i]) or "the run config"
            raise ValueError(f"{path!r}: {where} has no field {part!r}; fields: {sorted(fields)}")
        annotation = fields[part].annotation
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if i < len(parts) - 1:
            if not is_section:
                raise ValueError(f"{path!r}: {'.'.join(parts[:i + 1])} is a setting, not a section")
            model = annotation
        elif is_section:
            raise ValueError(f"{path!r} is a section; name one of its settings: "
                             f"{sorted(f'{path}.{k}' for k in annotation.model_fields)}")
    return path


def nested(path: str, value: Any) -> dict[str, Any]:
    """`nested("optim.lr", 1e-3)` -> {"optim": {"lr": 1e-3}}."""
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def flattened(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`nested`'s inverse over a whole document: {"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}. An
    empty section sets nothing (as `deep_merge` reads it) and yields nothing."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        path = f"{prefix}{key}"
        out.update(flattened(value, f"{path}.") if isinstance(value, dict) else {path: value})
    return out


def config_diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two config documents differ, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for key in sorted(set(old) | set(new), key=str)
                for line in config_diff(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge `update` into a copy of `base` (lists and scalars are replaced)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """`optim.lr=1e-3` -> (['optim', 'lr'], 0.001); the value is parsed as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value (e.g. optim.lr=1e-3), got {item!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: value is not valid YAML ({e})") from None
    if isinstance(value, str):  # YAML reads '1e-3' as a string; accept it as a float
        try:
            value = float(value)
        except ValueError:
            pass
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set a.b.c=value` overrides to a nested dict (a new dict is returned)."""
    out = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return out


def utf8_text(path: Path) -> str:
    """A text file's content. Every file AltGrad reads is UTF-8 (it writes them so; a user's own
    are read as such, whatever the locale): one that is not is a ConfigError naming the file and
    the line, where Python's error names neither."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line} is not UTF-8 text ({e.reason}); save the file as UTF-8") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, turning file and syntax problems into ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(utf8_text(path)) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def describe_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the dotted field path, e.g. `optim.lr: must be > 0`."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith(("function-after", ONE_OF_MEMBER)))
        loc = f"{prefix}{loc}" if loc else (prefix.rstrip(".") or "config")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see sweeps/configs/*.yaml for valid keys)"
        lines.append(f"  {loc}: {msg}")
    return "invalid configuration:\n" + "\n".join(lines)


def resolve_preset(name: Any) -> str:
    """`None`/`auto` -> `gpu` when CUDA is available, else `cpu`. `name` is whatever the YAML or
    `--set` gave (`preset: [a]` is a list), so anything but a preset's name is a ConfigError."""
    if name in (None, "auto"):
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return name


def build_run_config(data: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """Preset (named by `preset:` in the data, or auto) < data < overrides, then validate."""
    data = apply_overrides(data, overrides or [])
    preset = resolve_preset(data.get("preset"))
    merged = deep_merge(PRESETS[preset], {**data, "preset": preset})
    try:
        return RunConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(describe_validation_error(e)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a run config from YAML (optional) with `--set` overrides applied on top."""
    data = read_yaml(path) if path else {}
    if {"grid", "base"} & set(data):  # (neither is a run's field)
        raise ConfigError(f"{path} is a sweep config (it has {', '.join(sorted({'grid', 'base'} & set(data)))}), not "
                          f"a run config: run it with its sweep, python sweeps/format_ablation.py (or sweeps/lr_search.py) "
                          f"--config {path}, or give train a run's fields (a trial's config.yaml is one)")
    return build_run_config(data, overrides)


def dump_config(cfg: RunConfig) -> str:
    """YAML text that `load_config` reads back to an equal RunConfig."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
