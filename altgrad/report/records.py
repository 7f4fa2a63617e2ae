"""What the report reads off one trial's record: its name and grid point, its stop and where it
failed, the warnings it raised, its seeds' losses and shadow cosines, how far it evaluated.

Pure functions of `TrialRecord`s (no I/O); `findings` builds the cells and comparisons from them,
and `plots` draws the same readings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from altgrad.config import StabilityConfig
from altgrad.experiment import (
    BROKEN_STOPS,
    UNFINISHED,
    EventKind,
    StopReason,
    TrialRecord,
    axis_names,
    axis_value_text,
    unfinished_text,
)
from altgrad.metrics import (
    BACKWARD_OVERFLOW_RATE,
    BACKWARD_UNDERFLOW_RATE,
    BIT_STALL_RATE,
    FORWARD_OVERFLOW_RATE,
    FORWARD_UNDERFLOW_RATE,
    GRAD_DEAD_FRAC,
    GRAD_HAS_NAN,
    LOSS_IS_NAN,
    OVERFLOW_RATE,
    SHADOW_COS_MEAN,
    STEP,
    TRAIN_LOSS,
    UNDERFLOW_RATE,
    ZERO_UPDATE_FRAC,
    layer_values,
)
from altgrad.precision import BASELINE
from altgrad.quant.formats import exmy_bits

# Where a failure is placed: a collapse by the pass its trainer saw go non-finite (summary.json
# `collapse_where`), a stall in the optimizer; the signals (`signals`) name more precise sites.
WHERE = {"forward": "forward (non-finite loss)", "backward": "backward (non-finite gradient)",
         "optimizer": "optimizer stall"}


WINDOW = 5  # logged rows up to the stop that are read for a non-finite loss or gradient


def signals(stability: StabilityConfig) -> tuple[tuple[str, float, str], ...]:
    """(metric, threshold, where) per failure signal: a signal above its threshold points there.
    Every threshold is the run's own (`stability`): overflow, underflow and bit-stall its warning
    levels (SPEC §5), the dead-gradient fraction (the mean over layers) and the zero-update
    fraction its `dead_grad_signal` and `zero_update_signal`. Overflow and underflow are read by
    pass; the rates over both passes only name no pass (runs recorded before the rates by pass)
    and, listed last, win no tie: a pass's rate is at least the two passes' rate where it leads."""
    return (
        (FORWARD_OVERFLOW_RATE, stability.overflow_warn, "forward overflow"),
        (BACKWARD_OVERFLOW_RATE, stability.overflow_warn, "backward overflow"),
        (FORWARD_UNDERFLOW_RATE, stability.underflow_warn, "forward underflow"),
        (BACKWARD_UNDERFLOW_RATE, stability.underflow_warn, "backward underflow"),
        (GRAD_DEAD_FRAC, stability.dead_grad_signal, "backward underflow"),
        (BIT_STALL_RATE, stability.stall_warn, WHERE["optimizer"]),
        (ZERO_UPDATE_FRAC, stability.zero_update_signal, WHERE["optimizer"]),
        (OVERFLOW_RATE, stability.overflow_warn, "overflow"),
        (UNDERFLOW_RATE, stability.underflow_warn, "underflow"),
    )


AxesKey = tuple[tuple[str, Any], ...]  # an extra-axis assignment, sorted by dotted path


def format_key(name: str) -> tuple[int, str]:
    """Sort bf16 first, then eXmY by exponent bits (E0M7 … E7M0), then anything else by name."""
    if name == BASELINE:
        return (-1, name)
    bits = exmy_bits(name)
    return (bits[0], name) if bits else (99, name)


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def label(r: TrialRecord) -> str:
    return f"{r.format} / {r.optimizer} / {r.precision}"


def name(r: TrialRecord) -> str:
    """The grid point's name (e4m3-adamw-all-s42) where the sweep gave one, else the trial id."""
    return r.key or r.trial_id


def last_eval(r: TrialRecord) -> int | None:
    steps = r.val_series()[0]
    return steps[-1] if steps else None


def broke(r: TrialRecord) -> bool:
    return r.stop_reason in BROKEN_STOPS


# The events a run raises and goes on (SPEC §5: warnings, never a stop), as the report names them.
WARNING_NAMES = {
    EventKind.NAN_SKIP: "non-finite step skipped", EventKind.OVERFLOW_WARN: "overflow",
    EventKind.UNDERFLOW_WARN: "underflow", EventKind.BIT_STALL_WARN: "bit-stall",
    EventKind.KURTOSIS_WARN: "activation kurtosis", EventKind.DIVERGENCE_WARN: "val loss rising",
}


@dataclass(frozen=True)
class Warned:
    """One kind of warning over one grid point's seeds (bf16's included)."""

    format: str
    optimizer: str
    precision: str
    axes: AxesKey
    what: str  # a `WARNING_NAMES` value
    seeds: tuple[int, ...]  # the seeds that raised it
    of: int  # how many seeds the grid point ran
    first: int  # the first step any of them raised it at
    events: int  # how many times, over all its seeds (see `findings.DEFINITIONS`)


def warnings_raised(records: Iterable[TrialRecord]) -> list[Warned]:
    """Per grid point (format, optimizer, precision, extra axes) and kind of warning, who raised it
    and when, from the runs' events up to the sweep's stop: what no number of the tables says (a
    skipped non-finite step, a kurtosis spike)."""
    groups: dict[tuple[str, str, str, AxesKey], list[TrialRecord]] = {}
    for r in records:
        groups.setdefault((r.format, r.optimizer, r.precision, axes_key(r)), []).append(r)
    out = []
    for key, trials in groups.items():
        for kind, what in WARNING_NAMES.items():
            raised = {t.seed: steps for t in trials
                      if (steps := [e["step"] for e in t.events if e.get("kind") == kind])}
            if raised:
                out.append(Warned(*key, what, tuple(sorted(raised)), len(trials),
                                  min(min(s) for s in raised.values()), sum(len(s) for s in raised.values())))
    return sorted(out, key=lambda w: (format_key(w.format), w.optimizer, w.precision, w.axes))


def shifts_text(r: TrialRecord) -> str:
    """`3 shifts from step 12 (bit_stall, nan); layers ended in e1m6: lm_head; e3m4: h.0.mlp.c_fc`:
    how many, from when, why, and the format each shifted layer ended in (a run makes dozens when
    its layers stall: one entry per shift buried the answer)."""
    shifts = r.format_shifts
    ended: dict[str, list[str]] = {}
    for layer, fmt in {e["layer"]: e["to"] for e in shifts}.items():  # each layer's last shift
        ended.setdefault(fmt, []).append(layer)
    formats = "; ".join(f"{fmt}: {', '.join(layers)}" for fmt, layers in sorted(ended.items(),
                                                                                key=lambda item: format_key(item[0])))
    return (f"{len(shifts)} shift{'s' if len(shifts) > 1 else ''} from step {shifts[0]['step']} "
            f"({', '.join(sorted({e['reason'] for e in shifts}))}); layers ended in {formats}")


def stop_step(r: TrialRecord) -> tuple[int | None, bool]:
    """(step, is_collapse): where the trial collapsed, else where it stopped."""
    if _finite(r.summary.get("collapse_step")):
        return int(r.summary["collapse_step"]), True
    steps, losses = r.series(TRAIN_LOSS)
    bad = next((s for s, v in zip(steps, losses, strict=True) if not math.isfinite(v)), None)
    if bad is not None:
        return bad, True
    return last_logged_step(r), False


def last_logged_step(r: TrialRecord) -> int | None:
    """The last step the trial logged (from its history: a running trial's summary lags)."""
    last = r.history[-1][STEP] if r.history else r.summary.get("steps")
    return int(last) if _finite(last) else None


def _metric(row: dict[str, float], key: str) -> float:
    """A model-wide metric, or the mean of its per-layer values (`key/<layer>`)."""
    if key in row:
        return row[key]
    values = list(layer_values(key, row).values())
    return fmean(values) if values else math.nan


def metric_series(r: TrialRecord, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a model-wide metric over a trial's history, or of the mean over layers of
    a per-layer one (`grad/dead_frac`), as the failure analysis reads it; rows without it skipped."""
    rows = [row for row in r.history if key in row or layer_values(key, row)]
    return [int(row[STEP]) for row in rows], [_metric(row, key) for row in rows]


def failure_site(r: TrialRecord) -> tuple[str, str]:
    """(where, evidence) of a failure; see `findings.DEFINITIONS`. The evidence names the strongest signal."""
    if r.unreadable:
        return "unknown", f"its files could not be read: {r.unreadable}"
    step, _ = stop_step(r)
    upto = [row for row in r.history if step is None or row[STEP] <= step]
    rows = upto[-WINDOW:]
    signal = _strongest_signal(upto, rows, r.stability, r.stored_in_format)
    also = f"; {signal[1]}" if signal else ""
    if r.summary.get("collapse_where") in WHERE:
        return WHERE[r.summary["collapse_where"]], "recorded by the trainer" + also
    if r.stop_reason == StopReason.BIT_STALL:
        return WHERE["optimizer"], "stopped for bit-stall" + also
    if not rows:
        return "unknown", "no metrics recorded"
    last = rows[-1]
    for broken, site, what in (
        (not math.isfinite(last.get(TRAIN_LOSS, 0.0)) or last.get(LOSS_IS_NAN, 0) > 0,
         "forward", "loss non-finite"),
        (last.get(GRAD_HAS_NAN, 0) > 0, "backward", "gradient non-finite, loss finite"),
    ):
        if broken:
            return WHERE[site], f"{what} at step {last[STEP]:.0f}{also}"
    return signal if signal else ("—", "no signal above threshold")


def _strongest_signal(upto: list[dict[str, float]], last: list[dict[str, float]],
                      stability: StabilityConfig, stored_in_format: bool) -> tuple[str, str] | None:
    """(where, evidence) of the signal furthest above its threshold (by ratio), with the step where
    it was (its first, if several), if any is. Overflow and underflow are events, read in all the
    rows `upto` the stop: a run that diverged may have shown its cause at the start and only
    symptoms near the stop. A stall (bit-stall, updates left unchanged) is a state, read in the
    `last` rows: the learning-rate warm-up's first steps stall by construction. Bit-stall counts
    only for weights `stored_in_format`: over fp32 master weights, which keep what the 8-bit view
    rounds away, healthy runs stall most of their updates (`train.stability.stall_halts_learning`)."""
    best: tuple[float, str, str] | None = None
    for key, threshold, site in signals(stability):
        if key == BIT_STALL_RATE and not stored_in_format:
            continue
        rows = last if site == WHERE["optimizer"] else upto
        found = [(v, int(row[STEP])) for row in rows if math.isfinite(v := _metric(row, key))]
        value, at = max(found, key=lambda vs: (vs[0], -vs[1]), default=(0.0, 0))
        if value > threshold and (best is None or value / threshold > best[0]):
            best = (value / threshold, site, f"{key} = {value:.3g} > {threshold:g} at step {at}")
    return best[1:] if best else None


def axes_key(r: TrialRecord) -> AxesKey:
    return tuple(sorted(r.axes.items()))


def axes_text(axes: AxesKey) -> str:
    """`rounding=stochastic, lr=0.002` (the last part of each path), or "" without extra axes."""
    names = axis_names([path for path, _ in axes])
    return ", ".join(f"{names[path]}={axis_value_text(value)}" for path, value in axes)


def where_text(precision: str, optimizer: str, axes: AxesKey) -> str:
    """`all, adamw, rounding=stochastic`: a group of cells (a sweet spot's, a gradient ranking's)."""
    return ", ".join(x for x in (precision, optimizer, axes_text(axes)) if x)


def completed_budget(r: TrialRecord) -> bool:
    return r.stop_reason == StopReason.COMPLETED and r.status not in UNFINISHED


def seed_values(trials: Iterable[TrialRecord], upto: int | None = None) -> dict[int, float]:
    """Each seed's best val loss (up to step `upto`); non-finite where it has none."""
    return {t.seed: t.best_val_loss(upto) for t in trials}


def shadow_cosines(r: TrialRecord, upto: int | None = None) -> list[float]:
    """The trial's logged `SHADOW_COS_MEAN` values up to step `upto`, non-finite ones included."""
    steps, values = r.series(SHADOW_COS_MEAN)
    return [v for s, v in zip(steps, values, strict=True) if upto is None or s <= upto]


def gradient_cosine(r: TrialRecord, upto: int | None = None) -> float:
    """A trial's gradient cosine (see `findings.DEFINITIONS`) up to step `upto`: the mean of its finite
    shadow cosines, nan without one."""
    finite = [v for v in shadow_cosines(r, upto) if math.isfinite(v)]
    return fmean(finite) if finite else math.nan


def baseline_trials(bf16: list[TrialRecord], axes: AxesKey) -> list[TrialRecord]:
    """The bf16 trials that match a cell's axes: bf16 carries only the axes that apply to it."""
    wanted = set(axes)
    return [t for t in bf16 if set(axes_key(t)) <= wanted]


def furthest_eval(trials: Iterable[TrialRecord]) -> int:
    """The last evaluation any of `trials` reached (0: none evaluated yet)."""
    return max((s for t in trials if (s := last_eval(t)) is not None), default=0)


def unfinished_short(trials: Sequence[TrialRecord], steps: int | None = None) -> dict[int, tuple[int, str]]:
    """The seeds not stopped (still running, or not started) whose last evaluation came before
    `steps` (default: the furthest any of `trials` reached): they have not yet measured that budget
    and are left out of the numbers and the curves until they have (`short_seeds` says why)."""
    return short_seeds([t for t in trials if t.stop_reason is None], furthest_eval(trials) if steps is None else steps)


def short_seeds(trials: Sequence[TrialRecord], steps: int | None = None) -> dict[int, tuple[int, str]]:
    """The seeds, stopped or not, whose last evaluation came before `steps` (default: the furthest
    any of `trials` reached): (that step, why: its stop reason, else still running, or not
    started). A bf16 seed among them is no baseline."""
    if steps is None:
        steps = furthest_eval(trials)
    return {t.seed: (reached, t.stop_reason or (unfinished_text(t.status) if t.history else "not started"))
            for t in trials if (reached := last_eval(t) or 0) < steps}
