"""The stability policy (SPEC §5): NaN streaks stop a run; everything else is a warning event.

Runs on the host, after the step's one sync, on plain floats. Its state is part of the
checkpoint, so a resumed run warns and stops exactly where the uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from altgrad.config import RunConfig, StabilityConfig
from altgrad.experiment import EventKind, StopReason
from altgrad.metrics import (
    BIT_STALL_RATE,
    GRAD_HAS_NAN,
    KURTOSIS_MAX,
    LOSS_IS_NAN,
    OVERFLOW_RATE,
    UNDERFLOW_RATE,
    layer_values,
)

WARNINGS = {  # event kind -> (metric, config threshold attribute)
    EventKind.BIT_STALL_WARN: (BIT_STALL_RATE, "stall_warn"),
    EventKind.OVERFLOW_WARN: (OVERFLOW_RATE, "overflow_warn"),
    EventKind.UNDERFLOW_WARN: (UNDERFLOW_RATE, "underflow_warn"),
    EventKind.KURTOSIS_WARN: (KURTOSIS_MAX, "kurtosis_warn"),
}


@dataclass
class Event:
    kind: str
    message: str
    extra: dict[str, Any] = field(default_factory=dict)


ShiftFn = Callable[[list[str] | None, str], list[Event]]
"""Shift the named layers (None: every quantized layer) for a reason (the cause, `StopReason.NAN`
or `StopReason.BIT_STALL`, or `NAN_UNLOCALIZED`); the shifts that happened."""

NAN_UNLOCALIZED = "nan_unlocalized"
"""Shift reason when no step of a NaN streak could be traced to a layer: every layer shifts."""


def stall_halts_learning(run: RunConfig) -> bool:
    """Whether bit-stall means this run stopped learning: only when its weights are stored in
    their format. With fp32 master weights the master keeps accumulating the updates its 8-bit view
    rounds away, so a stalled view still learns (docs/design.md, "Bit-stall is not breakage"): a
    sweep's stopper leaves it alone, and no layer of it shifts format for stalling."""
    return run.quant.stores_weights_in_format  # (never the baseline: `QuantConfig` refuses it)


@dataclass
class StabilityMonitor:
    cfg: StabilityConfig
    # Whether a layer's bit-stall streak shifts its format (`stall_halts_learning`); NaN streaks
    # shift whatever the weights. Under fp32 master weights every format's view stalls >90 % late
    # in a healthy run, and stall shifts walked an e5m2 run's head down to e1m6 (docs/design.md).
    stall_shifts: bool
    nan_streak: int = 0
    collapse_step: int | None = None
    collapse_where: str | None = None
    active_warnings: list[str] = field(default_factory=list)
    last_val: float | None = None
    rising_evals: int = 0
    format_shifts: int = 0
    stall_streaks: dict[str, int] = field(default_factory=dict)
    nan_origins: list[str] = field(default_factory=list)
    last_finite: bool = True  # the last step observed was finite (a shift resets `nan_streak`, not this)

    def opens_nan_run(self, m: dict[str, float]) -> bool:
        """Whether this step, not yet observed, is the first non-finite one after a finite step:
        where save-on-anomaly saves the state before it (SPEC §5)."""
        return self.last_finite and not _finite_step(m)

    def observe_step(self, step: int, m: dict[str, float], shift: ShiftFn | None = None,
                     origin: list[str] | None = None) -> tuple[list[Event], str | None]:
        """Events for this step, and the stop reason (`StopReason.NAN`) if the run must end here.

        With `shift_patience` set and a `shift` function, a NaN streak or a layer's bit-stall
        streak of that length first tries an emergency mantissa shift; a shift resets the streak
        so training continues, and the NaN stop still applies once no layer can shift. A NaN
        streak shifts the layers its steps were traced to (`origin`, see `nan_origin`), collected
        over the streak; only when none was traced does every layer shift (`NAN_UNLOCALIZED`).
        """
        events: list[Event] = []
        patience = self.cfg.shift_patience if shift is not None else None
        loss_bad = m[LOSS_IS_NAN] > 0
        self.last_finite = _finite_step(m)
        if not self.last_finite:
            self.nan_streak += 1
            where = "forward" if loss_bad else "backward"
            if self.nan_streak == 1:
                self.collapse_step, self.collapse_where = step, where
                self.nan_origins = []
            origin = origin or []
            self.nan_origins += [name for name in origin if name not in self.nan_origins]
            events.append(Event(
                EventKind.NAN_SKIP,
                f"non-finite {'loss' if loss_bad else 'gradient'} ({where}); optimizer step skipped "
                f"(streak {self.nan_streak}/{self.cfg.nan_patience}); origin: {', '.join(origin) or 'unknown'}",
                {"streak": self.nan_streak, "where": where, "origin": origin},
            ))
            if patience and self.nan_streak >= patience:
                localized = bool(self.nan_origins)
                shifted = shift(list(self.nan_origins) if localized else None,
                                StopReason.NAN if localized else NAN_UNLOCALIZED)
                events += shifted
                if shifted:
                    self.format_shifts += len(shifted)
                    self.nan_streak = 0
                    self.nan_origins = []
                    return events, None
            if self.nan_streak >= self.cfg.nan_patience:
                events.append(Event(EventKind.NAN_STOP, f"{self.nan_streak} consecutive non-finite steps: stopping"))
                return events, StopReason.NAN
        else:
            self.nan_streak = 0
        if patience and self.stall_shifts:
            events += self._stall_shifts(m, patience, shift)
        events.extend(self._threshold_warnings(m))
        return events, None

    def _stall_shifts(self, m: dict[str, float], patience: int, shift: ShiftFn) -> list[Event]:
        """Per-layer streaks of diagnostic steps with bit-stall above the threshold."""
        stalled = []
        for name, rate in layer_values(BIT_STALL_RATE, m).items():
            above = rate > self.cfg.shift_stall_threshold
            self.stall_streaks[name] = self.stall_streaks.get(name, 0) + 1 if above else 0
            if self.stall_streaks[name] >= patience:
                stalled.append(name)
                self.stall_streaks[name] = 0
        shifted = shift(stalled, StopReason.BIT_STALL) if stalled else []
        self.format_shifts += len(shifted)
        return shifted

    def _threshold_warnings(self, m: dict[str, float]) -> list[Event]:
        """Warn when a metric crosses its threshold (once per excursion, not every step)."""
        events = []
        for kind, (metric, attr) in WARNINGS.items():
            if metric not in m:
                continue
            limit = getattr(self.cfg, attr)
            above = m[metric] > limit
            if above and kind not in self.active_warnings:
                self.active_warnings.append(kind)
                events.append(Event(kind, f"{metric} = {m[metric]:.4g} > {limit:g}", {"value": m[metric]}))
            elif not above and kind in self.active_warnings:
                self.active_warnings.remove(kind)
        return events

    def observe_eval(self, val_loss: float) -> list[Event]:
        """Divergence: validation loss rising for `divergence_patience` evaluations in a row."""
        rising = self.last_val is not None and (not math.isfinite(val_loss) or val_loss > self.last_val)
        self.rising_evals = self.rising_evals + 1 if rising else 0
        self.last_val = val_loss
        if self.rising_evals == self.cfg.divergence_patience:
            return [Event(EventKind.DIVERGENCE_WARN, f"validation loss rose {self.rising_evals} evaluations in a row")]
        return []

    @property
    def diverging(self) -> bool:
        return self.rising_evals >= self.cfg.divergence_patience

    def state_dict(self) -> dict[str, Any]:
        return {
            "nan_streak": self.nan_streak,
            "collapse_step": self.collapse_step,
            "collapse_where": self.collapse_where,
            "active_warnings": [str(kind) for kind in self.active_warnings],  # plain: weights_only loads
            "last_val": self.last_val,
            "rising_evals": self.rising_evals,
            "format_shifts": self.format_shifts,
            "stall_streaks": dict(self.stall_streaks),
            "nan_origins": list(self.nan_origins),
            "last_finite": self.last_finite,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        if "last_finite" not in state:  # (a checkpoint from before it was kept: inside a streak, not)
            self.last_finite = self.nan_streak == 0


def _finite_step(m: dict[str, float]) -> bool:
    """Whether the step's loss and gradients were finite (else it was skipped)."""
    return not (m[LOSS_IS_NAN] > 0 or m[GRAD_HAS_NAN] > 0)
