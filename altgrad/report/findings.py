"""The report's findings, computed from trial records only (pure functions, no I/O).

Everything the report states is derived here, so the numbers can be recomputed by hand from the
trial data; the definitions below are rendered verbatim into report.md (`DEFINITIONS`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import fmean

from altgrad.config import BASELINE
from altgrad.experiment import TrialRecord
from altgrad.report.twins import Twins, power_of_two_twins

STANDARD, MANIFOLD = "adamw", "manifold"
VERDICT_FORMAT, VERDICT_PRECISION, VERDICT_TOLERANCE = "e5m2", "all", 0.10
STABILITY_STOPS = ("nan", "bit_stall", "error")  # the trial broke, as opposed to finished/cut by ASHA
UNFINISHED = ("PENDING", "RUNNING", "PAUSED")
TIE_TOLERANCE = 1e-9  # relative: ratios closer than this are a tie

# The pass a failure is attributed to, keyed by summary.json `collapse_where` values.
WHERE = {"forward": "forward overflow", "backward": "backward underflow", "optimizer": "optimizer stall"}
WINDOW = 5  # logged rows up to the stop that are searched for signals
# (metric, threshold, site): a signal above its threshold points at that site. The thresholds are
# the trainer's warning levels (SPEC §5); `grad/dead_frac` is the mean over layers.
SIGNALS = (
    ("quant/overflow_rate", 0.01, "forward"),
    ("quant/underflow_rate", 0.01, "backward"),
    ("grad/dead_frac", 0.5, "backward"),
    ("quant/bit_stall_rate", 0.5, "optimizer"),
    ("quant/zero_update_frac", 0.5, "optimizer"),
)

DEFINITIONS = f"""\
- **Best val loss** of a trial: the lowest finite validation loss it reached (`summary.json`
  `best_val_loss`, or its `val/loss` history). A cell (format × optimizer × precision) averages it
  over seeds, ignoring seeds with no finite evaluation. **Steps**: the last evaluation it reached.
- **× bf16**: a cell's best val loss divided by bf16's best val loss *over the same budget*: the
  bf16 evaluations up to the cell's steps (for a cell that ran as long as bf16, simply bf16's
  `best_val_loss`), so a trial ASHA cut early is not compared with a longer bf16 run. bf16 means
  the bf16 trials of the same optimizer (mean over seeds); an optimizer without one borrows
  `{STANDARD}`'s and a note says so. Below 1 = better than bf16.
- **Sweet spot** of a layer precision, per optimizer: the lowest × bf16 among the eligible cells
  that trained longest (ASHA cuts the cells that were behind at a rung; such a cell wins only if
  nothing ran further). Not eligible: cells where any trial stopped for
  {" / ".join(STABILITY_STOPS)} (a format that trains to NaN is no sweet spot, whatever its loss
  before collapsing). Ties (within a relative {TIE_TOLERANCE:g}) go to the format with more exponent
  bits (more range, fewer overflows). The headline per precision applies the same rule across
  optimizers.
- **Failures**: every trial whose stop reason is not `completed` or that recorded a collapse. Step:
  `collapse_step` from the summary, else the first non-finite training loss, else the last step.
  Where: `collapse_where` when the trainer recorded it; a `bit_stall` stop is an optimizer stall;
  otherwise the last {WINDOW} logged rows up to that step are read: a non-finite loss means the
  forward pass broke, a non-finite gradient with a finite loss means the backward pass did; else the
  signal furthest above its threshold ({", ".join(f"`{k}` > {t:g}" for k, t, _ in SIGNALS)})
  names the site ({", ".join(f"{k} → {WHERE[s]}" for k, _, s in SIGNALS)}); "—" when none is.
- **Manifold vs standard**: best val loss with `{MANIFOLD}` minus with `{STANDARD}`, same format
  and precision (negative = manifold helps), and that difference relative to `{STANDARD}`; the
  note says when either was cut or broke (then the two ran for different budgets).
- **Verdict**: PASS when the {VERDICT_FORMAT} cell's × bf16 (above) is ≤ {1 + VERDICT_TOLERANCE:.2f}
  and none of its trials broke. The cell used is {VERDICT_FORMAT} / {VERDICT_PRECISION} / {STANDARD};
  without it, the {VERDICT_FORMAT} cell with the lowest × bf16, preferring precision
  `{VERDICT_PRECISION}`, then optimizer `{STANDARD}`. No {VERDICT_FORMAT} or no bf16 → INVESTIGATE.
"""


def format_key(name: str) -> tuple[int, str]:
    """Sort bf16 first, then eXmY by exponent bits (E0M7 … E7M0), then anything else by name."""
    if name == BASELINE:
        return (-1, name)
    m = re.fullmatch(r"e(\d+)m(\d+)", name)
    return (int(m.group(1)), name) if m else (99, name)


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


def trial_best(r: TrialRecord, upto: int | None = None) -> float:
    """Lowest finite val loss, over evaluations up to step `upto` (all when None); the summary's
    `best_val_loss` counts when the whole run does."""
    steps, values = r.val_series()
    values = [v for s, v in zip(steps, values, strict=True) if upto is None or s <= upto]
    if upto is None or not steps or upto >= steps[-1]:
        values.append(r.summary.get("best_val_loss"))
    return min((v for v in values if _finite(v)), default=math.nan)


def stop_reason(r: TrialRecord) -> str | None:
    return r.stop_reason or r.summary.get("stop_reason") or ("error" if r.status == "ERROR" else None)


def broke(r: TrialRecord) -> bool:
    return stop_reason(r) in STABILITY_STOPS


def stop_step(r: TrialRecord) -> tuple[int | None, bool]:
    """(step, is_collapse): where the trial collapsed, else where it stopped."""
    if _finite(r.summary.get("collapse_step")):
        return int(r.summary["collapse_step"]), True
    steps, losses = r.series("train/loss")
    bad = next((s for s, v in zip(steps, losses, strict=True) if not math.isfinite(v)), None)
    if bad is not None:
        return bad, True
    last = r.history[-1]["step"] if r.history else r.summary.get("steps")  # a running summary lags
    return (int(last) if _finite(last) else None), False


def _metric(row: dict[str, float], key: str) -> float:
    """A model-wide metric, or the mean of its per-layer values (`key/<layer>`)."""
    if key in row:
        return row[key]
    values = [v for k, v in row.items() if k.startswith(key + "/")]
    return fmean(values) if values else math.nan


def failure_site(r: TrialRecord) -> tuple[str, str]:
    """(where, evidence) of a failure; see DEFINITIONS. The evidence names the strongest signal."""
    step, _ = stop_step(r)
    rows = [row for row in r.history if step is None or row["step"] <= step][-WINDOW:]
    signal = _strongest_signal(rows)
    also = f"; {signal[1]}" if signal else ""
    if r.summary.get("collapse_where") in WHERE:
        return WHERE[r.summary["collapse_where"]], "recorded by the trainer" + also
    if stop_reason(r) == "bit_stall":
        return WHERE["optimizer"], "stopped for bit-stall" + also
    if not rows:
        return "unknown", "no metrics recorded"
    last = rows[-1]
    for broken, site, what in (
        (not math.isfinite(last.get("train/loss", 0.0)) or last.get("stability/loss_is_nan", 0) > 0,
         "forward", "loss non-finite"),
        (last.get("stability/grad_has_nan", 0) > 0, "backward", "gradient non-finite, loss finite"),
    ):
        if broken:
            return WHERE[site], f"{what} at step {last['step']:.0f}{also}"
    return (WHERE[signal[0]], signal[1]) if signal else ("—", "no signal above threshold")


def _strongest_signal(rows: list[dict[str, float]]) -> tuple[str, str] | None:
    """(site, evidence) of the signal furthest above its threshold (by ratio), if any is."""
    best: tuple[float, str, str] | None = None
    for key, threshold, site in SIGNALS:
        value = max((v for v in (_metric(row, key) for row in rows) if math.isfinite(v)), default=0.0)
        if value > threshold and (best is None or value / threshold > best[0]):
            best = (value / threshold, site, f"{key} = {value:.3g} > {threshold:g}")
    return best[1:] if best else None


@dataclass(frozen=True)
class Cell:
    """One grid point (8-bit format × optimizer × precision), aggregated over seeds."""

    format: str
    optimizer: str
    precision: str
    best: float  # mean over seeds of the best val loss
    steps: int  # the last evaluation any of its trials reached
    baseline: float  # bf16's best val loss up to `steps` (same training budget)
    trials: tuple[TrialRecord, ...]

    @property
    def ratio(self) -> float:
        return self.best / self.baseline

    @property
    def broke(self) -> bool:
        return any(broke(t) for t in self.trials)

    @property
    def running(self) -> bool:
        return any(t.status in UNFINISHED for t in self.trials)

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(sorted({s for t in self.trials if (s := stop_reason(t)) not in (None, "completed")}))


@dataclass(frozen=True)
class SweetSpot:
    precision: str
    optimizer: str
    winner: Cell | None  # None: every format of this precision broke or has no finite loss
    runner_up: Cell | None
    excluded: tuple[str, ...]  # formats not eligible because they broke


@dataclass(frozen=True)
class Failure:
    trial: TrialRecord
    step: int | None
    collapsed: bool
    stop_reason: str
    where: str
    evidence: str


@dataclass(frozen=True)
class Delta:
    """Manifold minus standard optimizer on one format and precision."""

    standard: Cell
    manifold: Cell

    @property
    def delta(self) -> float:
        return self.manifold.best - self.standard.best

    @property
    def relative(self) -> float:
        return self.delta / self.standard.best


@dataclass(frozen=True)
class Verdict:
    passed: bool
    ratio: float
    cell: Cell | None
    reason: str

    @property
    def line(self) -> str:
        ratio = f"ratio {self.ratio:.3f}" if math.isfinite(self.ratio) else "ratio n/a"
        return (f"{VERDICT_FORMAT.upper()} within {100 * VERDICT_TOLERANCE:.0f} % of BF16: "
                f"{'PASS' if self.passed else 'INVESTIGATE'} ({ratio}; {self.reason})")


@dataclass(frozen=True)
class Findings:
    formats: tuple[str, ...]  # 8-bit formats, E0M7 … E7M0
    optimizers: tuple[str, ...]
    precisions: tuple[str, ...]
    baselines: dict[str, list[TrialRecord]]  # optimizer -> the bf16 trials its ratios use
    cells: dict[tuple[str, str, str], Cell]  # (format, optimizer, precision)
    sweet_spots: list[SweetSpot]
    failures: list[Failure]
    deltas: list[Delta]
    verdict: Verdict
    missing: list[str]
    notes: list[str] = field(default_factory=list)
    twins: list[Twins] = field(default_factory=list)  # formats whose trials are one result

    def baseline_best(self, optimizer: str) -> float:
        """bf16's best val loss over its whole run, as compared with `optimizer`'s trials."""
        return _mean_best(self.baselines.get(optimizer, []))

    def headline(self, precision: str) -> SweetSpot | None:
        """The sweet spot of a precision over all optimizers (same rule as per optimizer)."""
        spots = [s for s in self.sweet_spots if s.precision == precision and s.winner]
        return min(spots, key=lambda s: (-s.winner.steps, s.winner.ratio), default=None)


def _ordered(values: Iterable[str], key=None) -> tuple[str, ...]:
    return tuple(sorted(set(values), key=key))


def _baselines(records: list[TrialRecord], optimizers: tuple[str, ...],
               notes: list[str]) -> dict[str, list[TrialRecord]]:
    """The bf16 trials each optimizer is compared with: its own, else `adamw`'s (else the first)."""
    own: dict[str, list[TrialRecord]] = {}
    for r in records:
        if r.format == BASELINE and math.isfinite(trial_best(r)):
            own.setdefault(r.optimizer, []).append(r)
    lender = STANDARD if STANDARD in own else next(iter(sorted(own)), None)
    for opt in optimizers:
        if opt not in own and lender is not None:
            notes.append(f"`{opt}` has no bf16 trial with a finite loss: its × bf16 uses the `{lender}` baseline.")
    return {opt: own.get(opt) or own[lender] for opt in optimizers if opt in own or lender is not None}


def _mean_best(trials: Iterable[TrialRecord], upto: int | None = None) -> float:
    bests = [b for t in trials if math.isfinite(b := trial_best(t, upto))]
    return fmean(bests) if bests else math.nan


def _sweet_spot(cells: list[Cell], precision: str, optimizer: str) -> SweetSpot:
    """Lowest × bf16 among the eligible cells that trained longest (see DEFINITIONS)."""
    eligible = [c for c in cells if not c.broke and math.isfinite(c.ratio)]
    eligible.sort(key=lambda c: (-c.steps, c.ratio))
    if eligible:  # a tie goes to the format with more exponent bits
        tied = [c for c in eligible if c.steps == eligible[0].steps
                and c.ratio <= eligible[0].ratio * (1 + TIE_TOLERANCE)]
        winner = max(tied, key=lambda c: format_key(c.format)[0])
        eligible.remove(winner)
        eligible.insert(0, winner)
    winner, runner_up = (eligible + [None, None])[:2]
    return SweetSpot(precision, optimizer, winner, runner_up, tuple(c.format for c in cells if c.broke))


def _verdict(cells: dict[tuple[str, str, str], Cell], has_baseline: bool) -> Verdict:
    candidates = [c for c in cells.values() if c.format == VERDICT_FORMAT]
    if not has_baseline:
        return Verdict(False, math.nan, None, "no bf16 baseline with a finite loss")
    if not candidates:
        return Verdict(False, math.nan, None, f"no {VERDICT_FORMAT} trial")
    cell = min(candidates, key=lambda c: (c.precision != VERDICT_PRECISION, c.optimizer != STANDARD,
                                          c.ratio if math.isfinite(c.ratio) else math.inf))
    where = f"{cell.format} / {cell.precision} / {cell.optimizer}"
    if not math.isfinite(cell.ratio):
        return Verdict(False, cell.ratio, cell, f"{where} has no finite val loss")
    if cell.broke:
        return Verdict(False, cell.ratio, cell, f"{where} stopped: {', '.join(cell.stops)}")
    return Verdict(cell.ratio <= 1 + VERDICT_TOLERANCE, cell.ratio, cell,
                   f"{where}: best val loss {cell.best:.4f} vs bf16 {cell.baseline:.4f}, up to step {cell.steps}")


def _missing(records: list[TrialRecord], axes: tuple[tuple[str, ...], ...], given: list[str]) -> list[str]:
    """Grid points the caller knows never started, unfinished trials, holes in the observed grid."""
    out = list(given)
    out += [f"{name(r)} ({label(r)}): unreadable: {r.unreadable}" for r in records if r.unreadable]
    for r in records:
        if r.status in UNFINISHED and name(r) not in given:
            state = "not started" if r.status == "PENDING" else f"still running at step {stop_step(r)[0]}, numbers provisional"
            out.append(f"{name(r)} ({label(r)}): {state}")
    formats, optimizers, precisions = axes
    present = {(r.format, r.optimizer, r.precision) for r in records}
    out += [f"{f}/{o}/{p}: no trial" for o in optimizers for p in precisions for f in formats
            if (f, o, p) not in present]
    out += [f"{BASELINE}/{o}: no baseline trial" for o in optimizers
            if not any(r.format == BASELINE and r.optimizer == o for r in records)]
    return list(dict.fromkeys(out))


def compute_findings(records: list[TrialRecord], missing: list[str] | None = None) -> Findings:
    """All findings of an experiment; `missing` names grid points that never started."""
    started = [r for r in records if r.status != "PENDING" or r.history]
    quantized = [r for r in started if r.format != BASELINE]
    formats = _ordered((r.format for r in quantized), key=format_key)
    optimizers = _ordered(r.optimizer for r in started)
    precisions = _ordered(r.precision for r in (quantized or started))
    notes: list[str] = []
    bf16 = _baselines(started, optimizers, notes)

    cells: dict[tuple[str, str, str], Cell] = {}
    for key in sorted({(r.format, r.optimizer, r.precision) for r in quantized}):
        trials = tuple(r for r in quantized if (r.format, r.optimizer, r.precision) == key)
        steps = max((s for t in trials if (s := last_eval(t)) is not None), default=0)
        cells[key] = Cell(*key, best=_mean_best(trials), steps=steps,
                          baseline=_mean_best(bf16.get(key[1], []), steps), trials=trials)

    spots = [_sweet_spot([c for c in cells.values() if c.precision == p and c.optimizer == o], p, o)
             for p in precisions for o in optimizers
             if any(c.precision == p and c.optimizer == o for c in cells.values())]

    failures = []
    for r in sorted(started, key=lambda r: (format_key(r.format), r.optimizer, r.precision, r.seed)):
        reason = stop_reason(r)
        step, collapsed = stop_step(r)
        if reason in (None, "completed") and not collapsed:
            continue
        where, evidence = failure_site(r)
        if r.error:
            evidence += f"; error: {r.error}"
        failures.append(Failure(r, step, collapsed, reason or "—", where, evidence))

    deltas = [Delta(cells[f, STANDARD, p], cells[f, MANIFOLD, p])
              for f in formats for p in precisions
              if (f, STANDARD, p) in cells and (f, MANIFOLD, p) in cells]

    return Findings(formats, optimizers, precisions, bf16, cells, spots, failures, deltas,
                    _verdict(cells, bool(bf16)),
                    _missing(records, (formats, optimizers, precisions), missing or []),
                    notes, _twins(formats, cells))


def _twins(formats: tuple[str, ...], cells: dict[tuple[str, str, str], Cell]) -> list[Twins]:
    """The twin formats of this grid, with how many of their shared cells trained identically."""
    out = []
    for t in power_of_two_twins(formats):
        pairs = [(c, cells[t.larger, o, p]) for (f, o, p), c in cells.items()
                 if f == t.smaller and (t.larger, o, p) in cells]
        same = sum(_histories(a) == _histories(b) for a, b in pairs)
        out.append(Twins(t.smaller, t.larger, t.shift, identical=same, shared=len(pairs)))
    return out


def _histories(cell: Cell) -> list[tuple[int, list[int], list[float]]]:
    return sorted((t.seed, *t.val_series()) for t in cell.trials)
