"""The metrics contract: the name of every metric a run records, and which steps carry it.

A run directory's `metrics.jsonl` has one row per logged step (`is_logged_step`: every
`train.log_interval` steps, at each checkpoint and the last step; and at a stop). Every name is
defined here once, and so is the rule of which steps carry which metrics (`is_diagnostic_step`,
`is_shadow_step`, `is_eval_step`): the trainer writes by them, and the sweep's deciders, its
estimate, the trial table and the report read by them.

Every logged row
    STEP; TRAIN_LOSS, TRAIN_PPL, TRAIN_LR, GRAD_NORM, TOKENS_PER_S;
    LOSS_IS_NAN, GRAD_HAS_NAN (1.0 when that step was non-finite and skipped), NAN_STREAK,
    DIVERGENCE, FORMAT_SHIFTS;
    VAL_LOSS, VAL_PPL: the latest evaluation, made at step VAL_STEP (`is_eval_step`).
Diagnostic steps (`is_diagnostic_step`), quantized runs
    model-wide OVERFLOW_RATE, UNDERFLOW_RATE (and each by pass: FORWARD_OVERFLOW_RATE, ...),
    CODES_USED, BIT_STALL_RATE, ZERO_UPDATE_FRAC, KURTOSIS_MAX, and per layer (`per_layer(metric, layer)`) the first four, ACT_KURTOSIS and
    `gradient_stat(stat)` for each of `diagnostics.GRADIENT_STATS` (GRAD_DEAD_FRAC among them;
    `grad/snr` is the weight gradient's SQNR in dB under the run's grad_format, a format the bench
    never puts it in: `diagnostics.gradient_stats`). The quantizer counters behind the rates and
    CODES_USED count large tensors on a sample (`quant.step.sample`), scaled to the tensor's size.
Shadow steps (`is_shadow_step`)
    SHADOW_COS_MEAN, SHADOW_COS_MIN, and per layer SHADOW_COS.
Added by a sweep's trial to what it reports to Tune (not in metrics.jsonl)
    STALL_STREAK, STABLE_LR, DIVERGED.

Tune, W&B and the trial table get the model-wide metrics (`model_wide`); the per-layer ones stay
in metrics.jsonl, where the report reads them. The thresholds that act on these metrics are the
run's `stability` settings (`altgrad.config.StabilityConfig`), read by the trainer and the sweep.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module is names and rules only: it loads neither pydantic nor torch
    from altgrad.config import TrainConfig

STEP = "step"

TRAIN_LOSS = "train/loss"
TRAIN_PPL = "train/ppl"
TRAIN_LR = "train/lr"
GRAD_NORM = "train/grad_norm"
TOKENS_PER_S = "train/tokens_per_s"

LOSS_IS_NAN = "stability/loss_is_nan"
GRAD_HAS_NAN = "stability/grad_has_nan"
NAN_STREAK = "stability/nan_streak"
DIVERGENCE = "stability/divergence"
FORMAT_SHIFTS = "quant/format_shifts"

VAL_LOSS = "val/loss"
VAL_PPL = "val/ppl"
VAL_STEP = "val/step"

OVERFLOW_RATE = "quant/overflow_rate"  # over every quantized tensor: both passes
UNDERFLOW_RATE = "quant/underflow_rate"
# The same counts by pass: the forward quantizes inputs and weights, the backward grad_output.
FORWARD_OVERFLOW_RATE = "quant/forward_overflow_rate"
FORWARD_UNDERFLOW_RATE = "quant/forward_underflow_rate"
BACKWARD_OVERFLOW_RATE = "quant/backward_overflow_rate"
BACKWARD_UNDERFLOW_RATE = "quant/backward_underflow_rate"
RATES_BY_PASS = (FORWARD_OVERFLOW_RATE, FORWARD_UNDERFLOW_RATE, BACKWARD_OVERFLOW_RATE, BACKWARD_UNDERFLOW_RATE)
CODES_USED = "quant/codes_used"
BIT_STALL_RATE = "quant/bit_stall_rate"
ZERO_UPDATE_FRAC = "quant/zero_update_frac"
KURTOSIS_MAX = "act/kurtosis_max"
ACT_KURTOSIS = "act/kurtosis"  # per layer only
GRAD_DEAD_FRAC = "grad/dead_frac"  # per layer only; one of gradient_stat's

SHADOW_COS_MEAN = "shadow/cos_mean"
SHADOW_COS_MIN = "shadow/cos_min"
SHADOW_COS = "shadow/cos"  # per layer only

STALL_STREAK = "sweep/stall_streak"  # consecutive reports with bit-stall at or above the threshold
STABLE_LR = "sweep/stable_lr"  # the run's learning rate while it learns stably, else 0
DIVERGED = "sweep/diverged"  # 1 where the run has diverged so far (`trial_spec.verdict`), else 0

# What every report of a sweep's trial carries (the docstring's "every logged row", and the
# trial's own signals): a scheduler's metric must be one of these, or Ray fails the sweep at the
# first report that lacks it.
EVERY_REPORT = (TRAIN_LOSS, TRAIN_PPL, TRAIN_LR, GRAD_NORM, TOKENS_PER_S, LOSS_IS_NAN, GRAD_HAS_NAN, NAN_STREAK,
                DIVERGENCE, FORMAT_SHIFTS, VAL_LOSS, VAL_PPL, STALL_STREAK, STABLE_LR, DIVERGED)


def per_layer(metric: str, layer: str) -> str:
    """The per-layer form of a model-wide metric, e.g. `quant/bit_stall_rate/h.0.mlp.c_fc`."""
    return f"{metric}/{layer}"


def gradient_stat(stat: str) -> str:
    """The metric of a gradient statistic (`diagnostics.GRADIENT_STATS`), reported per layer."""
    return f"grad/{stat}"


def layer_values(metric: str, row: Mapping[str, float]) -> dict[str, float]:
    """The per-layer values of a metric in a row, by layer name."""
    prefix = f"{metric}/"
    return {k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix)}


def model_wide(name: str) -> bool:
    """Whether a metric is model-wide (`group/name`) rather than per layer (`group/name/<layer>`)."""
    return name.count("/") <= 1


def is_checkpoint_step(train: TrainConfig, step: int) -> bool:
    """Whether a run saves a checkpoint after step `step` (1-based): every `checkpoint_interval`
    steps and at the last step."""
    return step % train.checkpoint_interval == 0 or step == train.max_steps


def is_logged_step(train: TrainConfig, step: int) -> bool:
    """Whether a run writes step `step` to metrics.jsonl and reports it: every `log_interval` steps
    and at each checkpoint (so a resumed run finds the rows its checkpoint covers), the last step
    included. A run that stops early logs its stop step too."""
    return step % train.log_interval == 0 or is_checkpoint_step(train, step)


def is_diagnostic_step(train: TrainConfig, step: int) -> bool:
    """Whether step `step` measures the quantizer, gradient and activation diagnostics: every
    `diag_every` steps (0: never) and step 1, so even a short run has a first reading."""
    return bool(train.diag_every) and (step % train.diag_every == 0 or step == 1)


def is_shadow_step(train: TrainConfig, step: int) -> bool:
    """Whether step `step` compares with the FP32 shadow: every `shadow_every` steps (0: never)
    and step 1."""
    return bool(train.shadow_every) and (step % train.shadow_every == 0 or step == 1)


def is_eval_step(train: TrainConfig, step: int) -> bool:
    """Whether step `step` evaluates the validation loss: every `eval_interval` steps, step 1 (the
    loss a run starts from) and the last step (the one it ends at)."""
    return step % train.eval_interval == 0 or step in (1, train.max_steps)
