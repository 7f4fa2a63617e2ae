"""The stability policy (SPEC §5): NaN streaks stop a run; everything else is a warning event.

Runs on the host, after the step's one sync, on plain floats. Its state is part of the
checkpoint, so a resumed run warns and stops exactly where the uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from altgrad.config import StabilityConfig

WARNINGS = {  # event kind -> (metric, config threshold attribute)
    "bit_stall_warn": ("quant/bit_stall_rate", "stall_warn"),
    "overflow_warn": ("quant/overflow_rate", "overflow_warn"),
    "underflow_warn": ("quant/underflow_rate", "underflow_warn"),
    "kurtosis_warn": ("act/kurtosis_max", "kurtosis_warn"),
}


@dataclass
class Event:
    kind: str
    message: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StabilityMonitor:
    cfg: StabilityConfig
    nan_streak: int = 0
    collapse_step: int | None = None
    collapse_where: str | None = None
    active_warnings: list[str] = field(default_factory=list)
    last_val: float | None = None
    rising_evals: int = 0

    def observe_step(self, step: int, m: dict[str, float]) -> tuple[list[Event], str | None]:
        """Events for this step, and the stop reason (`nan`) if the run must end here."""
        events: list[Event] = []
        loss_bad = m["stability/loss_is_nan"] > 0
        grad_bad = m["stability/grad_has_nan"] > 0
        if loss_bad or grad_bad:
            self.nan_streak += 1
            where = "forward" if loss_bad else "backward"
            if self.nan_streak == 1:
                self.collapse_step, self.collapse_where = step, where
            events.append(Event(
                "nan_skip",
                f"non-finite {'loss' if loss_bad else 'gradient'} ({where}); optimizer step skipped "
                f"(streak {self.nan_streak}/{self.cfg.nan_patience})",
                {"streak": self.nan_streak, "where": where},
            ))
            if self.nan_streak >= self.cfg.nan_patience:
                events.append(Event("nan_stop", f"{self.nan_streak} consecutive non-finite steps: stopping"))
                return events, "nan"
        else:
            self.nan_streak = 0
        events.extend(self._threshold_warnings(m))
        return events, None

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
            return [Event("divergence_warn", f"validation loss rose {self.rising_evals} evaluations in a row")]
        return []

    @property
    def diverging(self) -> bool:
        return self.rising_evals >= self.cfg.divergence_patience

    def state_dict(self) -> dict[str, Any]:
        return {
            "nan_streak": self.nan_streak,
            "collapse_step": self.collapse_step,
            "collapse_where": self.collapse_where,
            "active_warnings": list(self.active_warnings),
            "last_val": self.last_val,
            "rising_evals": self.rising_evals,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
