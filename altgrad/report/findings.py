"""The report's findings, computed from trial records only (pure functions, no I/O).

Everything the report states is derived here, from what each trial's record says (`records`), so
the numbers can be recomputed by hand from the trial data; the definitions below are rendered
verbatim into report.md (`DEFINITIONS`). Every comparison carries its uncertainty over seeds
(`report.stats`): a difference is called one only when the 95 % intervals separate; otherwise the
report says "indistinguishable". And since a report makes many such calls, each also says whether
it survives Holm's correction over the comparisons of its kind (`FamilyWise`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from altgrad.config import StabilityConfig
from altgrad.experiment import (
    BROKEN_STOPS,
    UNFINISHED,
    RunStatus,
    StopReason,
    TrialRecord,
    TrialStatus,
    axis_names,
    axis_value_text,
    overrides_text,
    unfinished_text,
)
from altgrad.metrics import SHADOW_COS_MEAN
from altgrad.precision import BASELINE
from altgrad.report.records import (
    WHERE,
    WINDOW,
    AxesKey,
    Warned,
    axes_key,
    axes_text,
    baseline_trials,
    broke,
    completed_budget,
    failure_site,
    format_key,
    furthest_eval,
    gradient_cosine,
    label,
    last_eval,
    last_logged_step,
    name,
    seed_values,
    shadow_cosines,
    shifts_text,
    short_seeds,
    signals,
    stop_step,
    unfinished_short,
    warnings_raised,
    where_text,
)
from altgrad.report.stats import (
    MIN_PAIRED,
    Comparison,
    FamilyWise,
    Interval,
    beside,
    difference_interval,
    family_wise,
    holds,
    interval_ends,
    leader_group,
    mean_interval,
    ratio_interval,
    reading,
    seeds_text,
    sides_kept,
)

STANDARD, MANIFOLD = "adamw", "manifold"
VERDICT_FORMAT, VERDICT_PRECISION, VERDICT_TOLERANCE = "e5m2", "all", 0.10

_DEFAULT_SIGNALS = signals(StabilityConfig())
DEFINITIONS = f"""\
- **Best val loss** of a trial: the lowest finite validation loss it reached up to a step. Every
  trial is evaluated on the same fixed validation tokens, whatever its seed. A **cell** is one
  grid point (format × optimizer × layer precision × extra-axis values); its value is the mean
  over seeds with a 95 % Student-t interval (mean ± t(0.975, n−1)·s/√n); one seed: "n = 1, no
  interval". **Steps**: the last evaluation any of its trials reached. A seed of the cell still
  running short of that is left out of the cell's numbers until it gets there, and said; one that
  was stopped (NaN, bit-stall, ASHA) stays, and the cell is marked broken. Where a seed broke
  before the final evaluation (bf16's furthest), the cell's × bf16 is shown but not read ("not
  compared") nor counted in the Holm family: that seed's best val loss is its best before it
  broke, perhaps its first evaluation, so instead the table gives each such seed's val loss at its
  last evaluation over its bf16 seed's at that step (paired, over the seeds where both are finite;
  mean ± t interval), how far behind it was when it stopped; seeds of the cell that ran the full
  budget are not in it, and said. A bf16 seed whose last evaluation came
  before the cell's steps is no baseline of it, and is said; a cell left with none (a format given
  a longer budget than bf16's, `grid.format_overrides`) is not compared.
- **× bf16**: per seed, the cell's best val loss divided by bf16's (same optimizer, same seed, same
  values of the extra axes that apply to bf16) over the same budget (bf16's evaluations up to the
  cell's steps), then the mean of these per-seed ratios with its t interval ("paired"). When the
  seed sets differ, the pairs are the seeds both have if there are at least {MIN_PAIRED} (the others
  are named); with fewer, the ratio of the means with a delta-method interval (Welch df,
  "unpaired"; none where either side has one seed), and the table says why. An optimizer without a bf16 trial borrows `{STANDARD}`'s.
- **Separates / indistinguishable**: two numbers are called different only when their 95 %
  intervals do not overlap; a cell is better or worse than bf16 only when its × bf16 interval
  excludes 1. Without an interval (one seed) nothing is called different: "not tested". An interval
  or a p near its call's boundary is printed with the places that show which side of it it lies on
  (1.01000 ± 0.00996 excludes 1, 1.01000 ± 0.01001 does not; p 0.0496).
- **Family-wise (Holm)**: at 95 % each, about one comparison in twenty excludes its null by chance
  alone, and a report reads many. So every comparison with an interval also has its two-sided p
  (the t test its interval inverts: p < 0.05 when the interval excludes the null) and
  Holm's adjustment of it over its family, the comparisons of its kind in this report: every × bf16,
  every manifold − standard, every extra-axis effect, every gradient cosine − bf16 (one measurement
  listed under two names, a precision marked ≡ another, counts once). A call "holds"
  when its adjusted p is below 0.05: then the chance of any false call in its family is at most 5 %.
  A call that does not hold is a lead for more seeds, not a finding. The verdict is one comparison
  named in advance and is not adjusted; sweet-spot ties use the unadjusted intervals (a tie is
  already the cautious reading), and so does the split of gradient cosines into closest and further,
  which therefore says of each further cell whether its cosine − bf16 holds.
- **Sweet spot** of a layer precision (per optimizer and extra-axis values): among the cells that
  ran the full budget, did not break ({" / ".join(BROKEN_STOPS)}) and shifted no layer to another
  format before an evaluation (an emergency mantissa shift: the cell's numbers are then not its
  format's alone; one after a run's last evaluation changed nothing it measured), and bf16 (× 1
  exactly), the lowest × bf16, together with every cell whose × bf16 interval overlaps the leader's: one name is
  a sweet spot, several are a tie ("tie: e3m4 ≈ e4m3 ≈ bf16"). Overlap is not transitive, so a tie
  says where its members and bf16 part: in a tie with bf16, a member whose own × bf16 excludes 1
  ("yet e7m0 worse than bf16, not family-wise"); in a tie without it, the leader's call that left
  bf16 out ("bf16 left out: e4m3 better than bf16") and the members bf16's interval does not
  separate ("yet e7m0 indistinguishable from bf16"). A sweet spot bf16 leads, and a format alone,
  rest on × bf16 calls (bf16 leading: every eligible cell it leaves out is worse; a format alone: it
  is better than bf16) and say which of them do not hold family-wise ("bf16 (every format is worse;
  not family-wise for e4m3)", "tie: bf16 ≈ e7m0 (...; e4m3 left out as worse than bf16, not
  family-wise)"): a noisy cell ties where a precise one a hair behind is called worse. A ranking
  with a cell another precision's trials measured says so ("[e5m2: the trials of e5m2 / all]").
- **Failures**: every trial whose stop reason is not `completed` or that recorded a collapse. Step:
  `collapse_step` from the summary, else the first non-finite training loss, else the last step.
  Where: `collapse_where` when the trainer recorded it ({", ".join(f"{k} → {v}" for k, v in WHERE.items()
  if k != "optimizer")}); a `bit_stall` stop is an optimizer stall; otherwise the last {WINDOW}
  logged rows up to that step are read: a non-finite loss means the forward pass broke, a
  non-finite gradient with a finite loss means the backward pass did; else the
  signal furthest above its threshold names the site, with its step ({", ".join(
  f"{k} → {s}" for k, _, s in _DEFAULT_SIGNALS)}); "—" when none is. Overflow and underflow are read
  at every logged step up to the stop (a run that diverged often shows its cause early and only its
  symptoms near the stop); a stall (bit-stall, zero updates), a state, in those last rows (the
  learning-rate warm-up's first steps stall by construction), and bit-stall only where the weights
  are stored in their format (over fp32 master weights a healthy run stalls most of its 8-bit
  view's updates, which the master keeps). Every threshold
  is the run's own `stability` setting (its config.yaml; by default {", ".join(
  f"`{k}` > {t:g}" for k, t, _ in _DEFAULT_SIGNALS)}); the evidence names the one that applied.
- **Warnings**: the events a run raises and trains on (SPEC §5), per grid point and kind: a
  non-finite step skipped, overflow, underflow or bit-stall above its warning level, activation
  kurtosis above its level, the val loss rising `divergence_patience` evaluations in a row.
  A threshold's warning is raised once per excursion above it (the run's own `stability`
  setting), so "times raised" counts excursions, not steps; a skipped non-finite step is one event
  per step (a run the NaN stop ended lists the steps it skipped before). A level a format crosses by
  construction (e0m7's 7-bit grid flushes the small values of a Gaussian tensor) is a fact about the
  format, not a failure.
- **Manifold − standard**: per seed, best val loss with `{MANIFOLD}` minus with `{STANDARD}` (same
  format, precision and axes; both at full budget), mean ± t interval; negative = manifold helps.
  **Extra axes**: the same per-seed difference between two values of one axis, all else equal.
- **Gradient cosine** of a trial: the mean of `{SHADOW_COS_MEAN}` over its logged FP32-shadow steps
  (`shadow_every`, as logged) up to its stop (where it collapsed, else the last step it logged) or
  its cell's steps, whichever is first:
  the cosine between each linear layer's weight gradient and the one an FP32 copy of the same
  weights computes on the same batch, averaged over the layers. 1 is the FP32 direction; it
  measures what the format does to the gradient step by step, where the loss shows only what
  accumulated. A shadow step with a non-finite cosine (a non-finite gradient has no direction) is
  left out of the mean and counted in the table (after a collapse too, up to the last step it
  logged); a trial without a finite one has no cosine (left
  out, and said). **Cosine − bf16**: per seed, the cell's minus bf16's over the same steps, mean ±
  t interval; "lower" when the interval lies below 0; "not compared" (and out of the Holm family)
  where the cell's seeds stopped at different steps (its spread is then the budgets'; a cell
  whose seeds broke together stays: each is compared over the steps it ran). **Closest to FP32** (per
  layer precision, optimizer and extra-axis values, among the quantized cells eligible for the
  sweet spot; bf16, the reference of every cosine − bf16, is not ranked): the highest gradient cosine
  and every cell whose interval overlaps it, the sweet spot's rule, and as there a member whose
  own cosine − bf16 excludes 0 is said ("yet e4m3 lower than bf16"); the others are **further**,
  their intervals wholly below the leader's. A format can be further while its loss does not
  separate from bf16's: its gradients are measurably off, and at this budget the loss did not
  tell.
- **Verdict**: PASS when the upper end of the {VERDICT_FORMAT} cell's × bf16 interval is ≤
  {1 + VERDICT_TOLERANCE:.2f}: the cell {VERDICT_FORMAT} / {VERDICT_PRECISION} / {STANDARD} (the first
  extra-axis values) wherever the grid has it, whatever became of it; only a grid without it is
  judged on the {VERDICT_FORMAT} cell that ran the full budget, preferring precision
  `{VERDICT_PRECISION}`, then `{STANDARD}`. A cell that broke, shifted a layer to another format
  before an evaluation or was cut before the full budget, a missing bf16, or a single seed (no
  interval) → INVESTIGATE, with the reason.
"""

Compared = TypeVar("Compared", "Cell", "Difference", "GradientFidelity")  # a comparison of a table (`_with_family_wise`)


@dataclass(frozen=True)
class Cell:
    """One grid point, aggregated over seeds, with its comparison to bf16 at the same budget."""

    format: str
    optimizer: str
    precision: str
    axes: AxesKey
    trials: tuple[TrialRecord, ...]
    steps: int  # the last evaluation any of its trials reached
    best: Interval  # best val loss up to `steps`, over the seeds that evaluated there
    ratio: Comparison  # × bf16, paired by seed where possible
    also: tuple[str, ...] = ()  # equivalent formats this cell's trials measure too (one measurement)
    short: tuple[int, ...] = ()  # unfinished seeds short of `steps`: left out of its numbers
    short_baseline: tuple[int, ...] = ()  # bf16 seeds evaluated short of `steps`: no baseline of it
    family_wise: FamilyWise | None = None  # of `ratio`, over every cell's × bf16
    # A seed broke before the final evaluation: its best val loss may predate the breaking, so the
    # cell's × bf16 is not read; `at_stop` is each such seed's val loss at its last evaluation over
    # its bf16 seed's at that step, how far behind it was when it stopped (the seeds that ran the
    # full budget are not in it: their ratio at the end is not a breaking's).
    broke_early: bool = False
    at_stop: Comparison | None = None
    broke_seeds: tuple[int, ...] = ()  # the seeds that broke before the final evaluation
    # Why no bf16 seed is a baseline of it (every one evaluated short of its steps: a format that ran
    # longer than bf16, by `grid.format_overrides`), e.g. "no bf16 seed evaluated up to its step 50,
    # bf16's last evaluation being at step 40"; "" where some is.
    no_baseline: str = ""
    # The layer precision whose cell measured this one: its precision quantizes the same layers in
    # the same formats for this format (a custom policy that is a preset here), so its trials are
    # that cell's, listed under both, and each comparison counts once in its Holm family.
    twin_of: str = ""

    @property
    def precision_label(self) -> str:
        """Its layer precision as the report names it: `attn_e5m2 ≡ all` for a twin."""
        return f"{self.precision} ≡ {self.twin_of}" if self.twin_of else self.precision

    @property
    def measurement(self) -> tuple[str, str, str, AxesKey]:
        """The cell whose trials measured it: itself, or its `twin_of`'s."""
        return self.format, self.optimizer, self.twin_of or self.precision, self.axes

    @property
    def name(self) -> str:
        return " ≡ ".join((self.format, *self.also))

    @property
    def broke(self) -> bool:
        return any(broke(t) for t in self.trials)

    @property
    def running(self) -> bool:
        return any(t.status in UNFINISHED for t in self.trials)

    @property
    def full_budget(self) -> bool:
        return bool(self.trials) and all(completed_budget(t) for t in self.trials)

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(sorted({s for t in self.trials if (s := t.stop_reason) not in (None, StopReason.COMPLETED)}))

    @property
    def overrides(self) -> dict[str, Any]:
        """The settings its format ran with on top of the sweep's base (`TrialRecord.overrides`)."""
        return self.trials[0].overrides if self.trials else {}

    @property
    def shifted(self) -> tuple[int, ...]:
        """Seeds whose run shifted a layer to another format before an evaluation: its numbers are
        not the format's alone (`TrialRecord.shifted_before_eval`)."""
        return tuple(sorted(t.seed for t in self.trials if t.shifted_before_eval))

    @property
    def own_full_run(self) -> bool:
        """Ran the full budget, did not break and shifted no layer's format before an evaluation:
        its numbers are its format's, which a ranking (sweet spot, verdict, closest gradients) needs."""
        return self.full_budget and not self.broke and not self.shifted

    @property
    def shift_text(self) -> str:
        """`format shift in seeds {0, 2}`, as the tables mark a shifted cell ("" for none)."""
        n = len(self.shifted)
        return f"format shift in seed{'s' if n > 1 else ''} {seeds_text(self.shifted)}" if n else ""

    @property
    def mixed_budgets(self) -> bool:
        """Whether the seeds its numbers use were evaluated up to different steps (one broke early):
        their spread is then the budgets', not the seeds', and it is compared with nothing."""
        return len({last_eval(t) or 0 for t in self.trials if t.seed not in self.short}) > 1

    @property
    def unevaluated(self) -> bool:
        """No trial of it has evaluated yet, and none broke (an unreadable one did)."""
        return not self.steps and not self.broke

    @property
    def compared(self) -> bool:
        """Whether its × bf16 is read (called and counted in the Holm family): not where a seed broke
        before the final evaluation, nor where its seeds stopped at different steps (`vs_bf16`)."""
        return not (self.broke_early or self.mixed_budgets or self.no_baseline)

    @property
    def vs_bf16(self) -> str:
        """"better" / "worse" when the × bf16 interval excludes 1, else "indistinguishable"; "not
        compared" where a seed broke before the final evaluation (its best val loss is its best
        before it broke, perhaps its first evaluation, not a measure of the format: the loss where
        it stopped is said instead), or where its seeds stopped at different steps."""
        why = []
        if self.broke_early:
            at, early = self.at_stop, self.broke_seeds
            seeds = f"seed {early[0]}" if len(early) == 1 else f"seeds {seeds_text(early)}"
            there = (f"; val loss at the last evaluation of {seeds} {at.text(2)} × {BASELINE}'s there"
                     if at is not None and math.isfinite(at.mean) else "")
            if ran := sorted(t.seed for t in self.trials if t.seed not in early and t.seed not in self.short):
                there += f"; seed{'s' * (len(ran) > 1)} {seeds_text(ran) if len(ran) > 1 else ran[0]} ran to the final evaluation"
            why.append(f"broke before the final evaluation: {', '.join(self.stops)}{there}")
        if self.mixed_budgets:
            why.append("seeds stopped at different steps")
        if self.no_baseline:
            why.append(self.no_baseline)
        return reading(self.ratio, "better", "worse") if self.compared else f"not compared ({'; '.join(why)})"


@dataclass(frozen=True)
class SweetSpot:
    precision: str
    optimizer: str
    axes: AxesKey
    group: tuple[str, ...]  # the leader and every name tied with it ("bf16" may be one of them)
    leader: Cell | None  # None: bf16 leads, or no eligible cell
    excluded: tuple[str, ...]  # formats not eligible: not `Cell.own_full_run`, or no finite ratio
    # The × bf16 calls a sweet spot rests on (bf16 leading, alone or in a tie: the "worse" of every
    # eligible cell it leaves out; a format leading alone: its own "better"); the cells of those
    # calls that do not hold family-wise.
    not_family_wise: tuple[str, ...] = ()
    # names in a tie group without an interval (one seed): they tie because nothing can separate them
    no_interval: tuple[str, ...] = ()
    # Overlap with the leader is not transitive, so a tie says where its members and bf16 part
    # (`_tie_and_bf16`): "yet e7m0 worse than bf16" in a tie with bf16, which would read as "all
    # equal to bf16"; "bf16 left out: e4m3 better than bf16" and "yet e7m0 indistinguishable from
    # bf16" in one without, which would read as "all better than bf16".
    apart: tuple[str, ...] = ()
    # (format, precision) of each cell here measured by another precision's trials (`Cell.twin_of`):
    # a ranking that reads as this precision's own result would otherwise hide that it is not
    twins: tuple[tuple[str, str], ...] = ()

    @property
    def text(self) -> str:
        return f"{self._ranking} [{twins}]" if (twins := twins_text(self.twins)) else self._ranking

    @property
    def _ranking(self) -> str:
        if not self.group:
            return "none (no eligible cell)"
        if len(self.group) > 1:
            unheld = ([f"{', '.join(self.not_family_wise)} left out as worse than {BASELINE}, not family-wise"]
                      if self.not_family_wise else [])
            why = "; ".join((tie_reason(self.group, self.no_interval), *self.apart, *unheld))
            return f"tie: {' ≈ '.join(self.group)} ({why})"
        if self.leader is None:
            caveat = f"; not family-wise for {', '.join(self.not_family_wise)}" if self.not_family_wise else ""
            if self.excluded:
                return f"{BASELINE} (every eligible format is worse{caveat}; not eligible: {', '.join(self.excluded)})"
            return f"{BASELINE} (every format is worse{caveat})"
        caveat = f" (better than {BASELINE}, not family-wise)" if self.not_family_wise else ""
        return f"{self.leader.name} at {self.leader.ratio.text(3)} × {BASELINE}{caveat}"


def twins_text(twins: Iterable[tuple[str, str]]) -> str:
    """"e5m2: the trials of e5m2 / all" for each (cell name, `Cell.twin_of`) among cells ranked or
    drawn together that another precision's trials measured; "" for none."""
    return "; ".join(f"{name}: the trials of {name} / {precision}" for name, precision in twins)


@dataclass(frozen=True)
class Failure:
    trial: TrialRecord
    step: int | None
    collapsed: bool
    stop_reason: str
    where: str
    evidence: str


@dataclass(frozen=True)
class Difference:
    """`b` − `a` per seed (e.g. manifold − adamw, stochastic − nearest), with its interval."""

    what: str  # "manifold − adamw", "rounding: stochastic − nearest"
    a: Cell
    b: Cell
    diff: Comparison
    family_wise: FamilyWise | None = None  # of `diff`, over the differences of its table

    @property
    def verdict(self) -> str:
        return reading(self.diff, "lower (better)", "higher (worse)")


@dataclass(frozen=True)
class GradientFidelity:
    """A cell's gradient cosine against bf16's (same seeds, same steps): how far the format turns
    the gradient away from FP32's, whatever it did to the loss."""

    cell: Cell
    cosine: Interval  # the cell's, over seeds
    baseline: Interval  # bf16's, over the seeds it is compared on
    diff: Comparison  # cell − bf16, per seed
    nonfinite: int  # the cell's shadow steps with a non-finite cosine, left out of `cosine`
    shadow_steps: int  # all of the cell's shadow steps counted
    family_wise: FamilyWise | None = None  # of `diff`, over every cell's

    @property
    def verdict(self) -> str:
        """"lower" / "higher" when the interval excludes 0; "not compared" where the cell's seeds
        stopped at different steps (each seed's window then differs: its spread is the budgets'),
        as its × bf16 is not, or where no bf16 seed ran its steps (`Cell.no_baseline`)."""
        if self.cell.no_baseline:
            return f"not compared ({self.cell.no_baseline})"
        if not self.compared:
            return "not compared (seeds stopped at different steps)"
        return reading(self.diff, "lower", "higher")

    @property
    def compared(self) -> bool:
        """Whether its cosine − bf16 is read and counted in the Holm family (`verdict`)."""
        return not (self.cell.mixed_budgets or self.cell.no_baseline)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    cell: Cell | None
    reason: str
    baseline: str = BASELINE  # what the ratio divides by, where bf16 was not bf16 ("bf16 run in fp32")

    @property
    def line(self) -> str:
        ratio = (f"× {self.baseline} {self.cell.ratio.text(self.places())}"
                 if self.cell and math.isfinite(self.cell.ratio.mean) else "ratio n/a")
        return (f"{VERDICT_FORMAT.upper()} within {100 * VERDICT_TOLERANCE:.0f} % of BF16: "
                f"{'PASS' if self.passed else 'INVESTIGATE'} ({ratio}; {self.reason})")

    def places(self) -> int:
        """Places for the ratio that put its printed upper end on the side of the limit the
        verdict reads ('1.080 ± 0.020' reads as a pass whose interval reaches 1.10004)."""
        r = self.cell.ratio
        if not r.bounded or not math.isfinite(r.half_width):
            return 3
        return sides_kept(lambda k: interval_ends(r.mean, r.half_width, k)[1:], [r.hi], 1 + VERDICT_TOLERANCE,
                          r.places(3))


@dataclass(frozen=True)
class Findings:
    formats: tuple[str, ...]  # 8-bit formats, E0M7 … E7M0 (equivalent ones included)
    optimizers: tuple[str, ...]
    precisions: tuple[str, ...]
    axes: tuple[AxesKey, ...]  # every extra-axis assignment of a quantized cell
    baselines: dict[str, list[TrialRecord]]  # optimizer -> the bf16 trials its ratios use
    cells: dict[tuple[str, str, str, AxesKey], Cell]  # (format, optimizer, precision, axes)
    aliases: dict[str, str]  # equivalent format -> the format whose trials measured it
    sweet_spots: list[SweetSpot]
    failures: list[Failure]
    deltas: list[Difference]  # manifold − adamw
    axis_effects: list[Difference]  # one value of an extra axis against its first value
    verdict: Verdict
    missing: list[str]
    notes: list[str] = field(default_factory=list)
    fidelity: list[GradientFidelity] = field(default_factory=list)  # cells with a gradient cosine
    warnings: list[Warned] = field(default_factory=list)

    def cell(self, fmt: str, optimizer: str, precision: str, axes: AxesKey) -> Cell | None:
        """The cell of a format, or of the format whose trials measured it."""
        return self.cells.get((self.aliases.get(fmt, fmt), optimizer, precision, axes))

    def multiplicity(self) -> list[str]:
        """Per family of comparisons (see DEFINITIONS): how many have an interval, how many of them
        are calls at 95 % each, how many calls chance alone would make, and how many hold under
        Holm's correction; a family with no interval is left out."""
        families = (("× " + BASELINE, [c.family_wise for c in self.cells.values()]),
                    (f"{MANIFOLD} − {STANDARD}", [d.family_wise for d in self.deltas]),
                    ("extra-axis effects", [d.family_wise for d in self.axis_effects]),
                    (f"gradient cosine − {BASELINE}", [g.family_wise for g in self.fidelity]))
        out = []
        for what, members in families:
            tested = list({id(fw): fw for fw in members if fw is not None}.values())  # (a twin's is its cell's)
            if tested:
                called = [fw for fw in tested if fw.called]
                holding = sum(fw.holds for fw in called)
                out.append(f"{what}: {len(tested)} comparison{'s' * (len(tested) != 1)} with an interval, "
                           f"{len(called)} called at 95 % each where chance alone would call "
                           f"{tested[0].alpha * len(tested):.2g}; {holding} hold{'s' * (holding == 1)} "
                           "family-wise (Holm)")
        return out

    def fidelity_summary(self) -> list[str]:
        """Per layer precision, optimizer and extra-axis values (in grid order): the formats whose
        gradients are closest to FP32's, those further (see DEFINITIONS; each saying whether its
        cosine − bf16 holds family-wise), and which of the further ones have a loss that does not
        separate from bf16's: what the loss alone would hide."""
        out = []
        for where in ((p, o, ax) for p in self.precisions for o in self.optimizers for ax in self.axes):
            group = {g.cell.name: g for g in self.fidelity if (g.cell.precision, g.cell.optimizer, g.cell.axes)
                     == where and g.cell.own_full_run}
            # leader_group ranks the lowest first; the highest cosine leads here
            closest = leader_group((n, replace(g.cosine, mean=-g.cosine.mean)) for n, g in group.items())
            if not closest:
                continue
            further = sorted((g for n, g in group.items() if n not in closest and g.cosine.n),
                             key=lambda g: -g.cosine.mean)
            parts = [f"closest to FP32: {closest[0]} {group[closest[0]].cosine.text(3)}"
                     + "".join(f" ≈ {n}" for n in closest[1:])]
            # as a sweet spot's tie with bf16 says: a member whose own cosine − bf16 excludes 0
            apart = [f"yet {n} {g.verdict} than {BASELINE}" + ("" if holds(g.family_wise) else ", not family-wise")
                     for n in closest if (g := group[n]).diff.called]
            why = [tie_reason(closest, [n for n in closest if group[n].cosine.half_width is None])] * (len(closest) > 1)
            if why or apart:
                parts[0] += f" ({'; '.join([*why, *apart])})"
            if further:
                parts.append("further: " + ", ".join(
                    f"{g.cell.name} {g.cosine.text(3)}"
                    + ("" if holds(g.family_wise) else f" (− {BASELINE} not family-wise)")
                    for g in further))
                if hidden := [g.cell.name for g in further if not g.cell.ratio.called]:
                    parts.append(f"loss not separated from {BASELINE}'s for {', '.join(hidden)}")
            if twins := twins_text((g.cell.name, g.cell.twin_of) for g in group.values() if g.cell.twin_of):
                parts[-1] += f" [{twins}]"
            out.append(f"{where_text(*where)}: {'; '.join(parts)}")
        return out

    def measured_name(self, fmt: str) -> str:
        """A measured format's name with the equivalent formats its trials stand for (`e0m7 ≡ e1m6`),
        as its cells are named."""
        return " ≡ ".join((fmt, *sorted((a for a, m in self.aliases.items() if m == fmt), key=format_key)))

    def deltas_left_out(self) -> list[str]:
        """The cells run with both optimizers whose manifold − adamw is not taken, as `e4m3 / all
        (adamw: asha; manifold: asha)`: a side broke or ran short (`_difference`)."""
        taken = {(d.a.format, d.a.precision, d.a.axes) for d in self.deltas}
        out = []
        for (fmt, optimizer, precision, axes), a in self.cells.items():
            b = self.cells.get((fmt, MANIFOLD, precision, axes))
            if optimizer != STANDARD or b is None or (fmt, precision, axes) in taken:
                continue
            out.append(f"{a.name} / {where_text(precision, '', axes)} ({_sides_short((STANDARD, a), (MANIFOLD, b))})")
        return out

    def axis_effects_left_out(self) -> list[str]:
        """The pairs of cells an extra axis's effect would compare that it does not, as `e5m2 /
        all, manifold: master_weights format − fp32 (format: bit_stall)`: a side broke or ran short."""
        taken = {(id(d.a), id(d.b)) for d in self.axis_effects}
        out = []
        for what, a, b in _axis_pairs(self.cells, self.axes):
            if (id(a), id(b)) not in taken:
                held = tuple(i for i in a.axes if i in b.axes)
                path = next(p for p, v in b.axes if (p, v) not in held)  # the axis the two differ in
                sides = [(axis_value_text(dict(c.axes)[path]), c) for c in (a, b)]
                out.append(f"{a.name} / {where_text(a.precision, a.optimizer, held)}: {what} ({_sides_short(*sides)})")
        return out

    def baseline_best(self, optimizer: str, axes: AxesKey = ()) -> Interval:
        """bf16's best val loss over its whole run, as compared with `optimizer`'s trials."""
        return mean_interval(seed_values(baseline_trials(self.baselines.get(optimizer, []), axes)).values())


def _overrides_note(records: Iterable[TrialRecord]) -> list[str]:
    """The note naming the settings each format set on top of the base (none: no note)."""
    by_format = {r.format: r.overrides for r in records if r.overrides}
    baseline = by_format.pop(BASELINE, None)
    notes = []
    if by_format:
        ran = "; ".join(f"{fmt} ran with {overrides_text(o)}" for fmt, o in
                        sorted(by_format.items(), key=lambda kv: format_key(kv[0])))
        against = f"{BASELINE} with its own (below)" if baseline else f"{BASELINE} with the base's"
        notes.append(f"**Settings by format** (`grid.format_overrides`): {ran}. Such a format's cells compare "
                     f"it, with these settings, against {against}: a difference is the format's and its "
                     "settings' together, not the format's alone.")
    if baseline:
        notes.append(f"**{BASELINE} ran with settings of its own** (`grid.format_overrides`): "
                     f"{overrides_text(baseline)}. Every × {BASELINE} divides by that run.")
    return notes


def tie_reason(names: Sequence[str], no_interval: Sequence[str]) -> str:
    """Why the names of a tie are one group ("intervals overlap", "no interval for e4m3: not
    tested"): a tie says only that nothing separates them, which with two seeds (t(0.975, 1) =
    12.7) is little and without an interval (one seed, or one pair with bf16) is nothing at all (see
    `reading`), and "≈" alone reads as "equal"."""
    why = [*(["intervals overlap"] if len(names) - len(no_interval) > 1 else []),
           *([f"no interval for {', '.join(no_interval)}: not tested"] if no_interval else [])]
    return "; ".join(why)


def _ordered(values: Iterable[str], key=None) -> tuple[str, ...]:
    return tuple(sorted(set(values), key=key))


def _baselines(records: list[TrialRecord], optimizers: tuple[str, ...],
               notes: list[str]) -> tuple[dict[str, list[TrialRecord]], set[str]]:
    """The bf16 trials each optimizer is compared with: its own, else `adamw`'s (else the first);
    and the optimizers other than `adamw` whose bf16 baseline is `adamw`'s training: borrowed, or
    equal to it seed for seed (`manifold`, which has no format's ULPs to step in there)."""
    own: dict[str, list[TrialRecord]] = {}
    for r in records:
        if r.format == BASELINE and math.isfinite(r.best_val_loss()):
            own.setdefault(r.optimizer, []).append(r)
    lender = STANDARD if STANDARD in own else next(iter(sorted(own)), None)
    borrowed = set()
    for opt in optimizers:
        if opt not in own and lender is not None:
            notes.append(f"`{opt}` has no {BASELINE} trial with a finite loss: its × {BASELINE} uses the `{lender}` "
                         "baseline.")
            borrowed.add(opt)
        elif opt != lender and lender is not None and _same_losses(own[opt], own[lender]):
            why = (f" {BASELINE} quantizes no weight, so `{MANIFOLD}` takes `{STANDARD}`'s steps there (it measures "
                   "a step in a format's ULPs)." if (opt, lender) == (MANIFOLD, STANDARD) else "")
            notes.append(f"`{opt}`'s {BASELINE} trials equal `{lender}`'s, seed for seed (best val loss, to the last "
                         f"bit): one measurement twice, not two that agree.{why}")
            borrowed.add(opt)
    baselines = {opt: own.get(opt) or own[lender] for opt in optimizers if opt in own or lender is not None}
    return baselines, borrowed if lender == STANDARD else set()


def _baseline_compute(bf16: list[TrialRecord]) -> tuple[str, list[str]]:
    """The baseline as the verdict's ratio names it, and the notes on what "bf16" computed in where
    it was not bf16 (SPEC §2: autocast bf16 where supported; the trainer autocasts on CUDA only)."""
    autocast = {t.autocast for t in bf16}
    if False not in autocast:
        return BASELINE, []
    if True in autocast:
        return BASELINE, [f"Some {BASELINE} trials computed in bf16 autocast (CUDA) and some in fp32 (no "
                          f"autocast on the CPU): their × {BASELINE} ratios do not share one baseline."]
    return f"{BASELINE} (run in fp32)", [
        f"**{BASELINE} here is the model in fp32**: bf16 autocast runs on CUDA only, so on this device the "
        f"baseline, and what every run leaves unquantized (attention, norms, softmax, loss), computed in fp32. "
        f"Every × {BASELINE} compares a format with fp32 compute."]


def _better_than_bf16(c: Cell, lent: bool, deltas: list[Difference], baseline_overrides: dict[str, Any]) -> str:
    """The note on a cell that trained better than bf16 beyond its interval. Where its optimizer's
    bf16 baseline is AdamW's training (`lent`), × bf16 holds the optimizer's own effect as well
    as the format's, and the ablation to read is manifold − adamw, not the format's roles. Where
    the format ran with settings of its own that bf16 did not (`grid.format_overrides`, its
    learning rate say), those are the first suspect."""
    where = f"{c.name} / {c.precision} / {c.optimizer}{' / ' + axes_text(c.axes) if c.axes else ''}"
    head = (f"{where} trained better than {BASELINE} beyond its interval (× {BASELINE} {c.ratio.text(3)}; "
            f"{c.family_wise.text}). ")
    if lent:
        d = next((d for d in deltas if d.b is c), None)
        read = (f"{d.what} there is {d.diff.text(4)} ({d.verdict}; {d.family_wise.text})" if d
                else f"compare it with {c.format} / {c.precision} / {STANDARD}")
        return head + (f"Its {BASELINE} baseline took `{STANDARD}`'s steps, so this ratio holds `{c.optimizer}`'s own "
                       f"effect as well as the format's: {read}.")
    if c.overrides != baseline_overrides:
        def settings(overrides: dict[str, Any]) -> str:
            return f"with {overrides_text(overrides)}" if overrides else "with the base's settings"
        return head + (f"It ran {settings(c.overrides)}, {BASELINE} {settings(baseline_overrides)} "
                       "(`grid.format_overrides`): the gain may be the settings', not the format's; run both "
                       "with the same to tell them apart.")
    return head + ("Published FP8 results run slightly worse than 16-bit, so treat this as an anomaly until an "
                   "ablation explains it, e.g. forward-only quantization: `--set \"grid.axes={quant.roles."
                   "grad_output: [true, false]}\"`.")


def _same_losses(a: list[TrialRecord], b: list[TrialRecord]) -> bool:
    """Whether two optimizers' bf16 trials have the same seeds and extra axes and, for each, the
    same best val loss (finite, equal as floats)."""
    def losses(trials: list[TrialRecord]) -> dict[tuple[int, AxesKey], float]:
        return {(t.seed, axes_key(t)): t.best_val_loss() for t in trials}

    return losses(a) == losses(b)


def _make_cell(key: tuple[str, str, str, AxesKey], trials: tuple[TrialRecord, ...],
               bf16: list[TrialRecord], also: tuple[str, ...]) -> Cell:
    steps = furthest_eval(trials)
    label = " ≡ ".join((key[0], *also))
    # A seed of the cell that has not finished, evaluated short of its steps, has not yet measured
    # the cell's budget: it is left out until it has. One that was stopped (NaN, bit-stall, or
    # ASHA, which stops only a trial that trails bf16 beyond the tolerance) stays: its loss is the
    # cell's result, and the cell is marked broken. Any bf16 seed short of the steps is no baseline.
    short = unfinished_short(trials, steps)
    baseline = baseline_trials(bf16, key[3])
    short_bf16 = short_seeds(baseline, steps)
    values = seed_values([t for t in trials if t.seed not in short], steps)
    ratio = ratio_interval(values, seed_values([t for t in baseline if t.seed not in short_bf16], steps),
                           labels=(label, BASELINE))
    no_baseline = (f"no {BASELINE} seed evaluated up to its step {steps}, {BASELINE}'s last evaluation being "
                   f"at step {furthest_eval(baseline)}" if steps and baseline and len(short_bf16) == len(baseline) else "")
    if not steps:  # no trial of the cell has evaluated yet: nothing to divide
        ratio = replace(ratio, note="no evaluation yet")
    else:
        why = [_short_text(name, cut, steps) for name, cut in ((label, short), (BASELINE, short_bf16)) if cut]
        if why:  # (with no baseline left, the pairing's own note would only repeat it)
            ratio = replace(ratio, note="; ".join(n for n in (*why, "" if no_baseline else ratio.note) if n))
    # A seed that broke before the final evaluation (bf16's furthest, else the cell's own) has a
    # best val loss that may predate the breaking; one stopped at or after it measured the budget.
    final = furthest_eval(baseline) or steps
    early = [t for t in trials if broke(t) and (last_eval(t) or 0) < final and t.seed not in short]
    at_stop = _at_stop(early, baseline, label) if early else None
    return Cell(*key, trials=trials, steps=steps, best=mean_interval(values.values()), ratio=ratio, also=also,
                short=tuple(sorted(short)), short_baseline=tuple(sorted(short_bf16)), broke_early=bool(early),
                at_stop=at_stop, broke_seeds=tuple(sorted(t.seed for t in early)), no_baseline=no_baseline)


def _at_stop(trials: Sequence[TrialRecord], baseline: Sequence[TrialRecord], label: str) -> Comparison | None:
    """Each seed's val loss at its last evaluation × its bf16 seed's at the same step, over the
    seeds where both are finite (`Cell.at_stop`): paired, or nothing. Seeds without such a partner
    (bf16 did not evaluate there, or the loss had gone non-finite) are left out, not compared
    unpaired: that would divide losses at different steps."""
    by_seed = {t.seed: dict(zip(*t.val_series(), strict=True)) for t in baseline}
    cell, base = {}, {}
    for t in trials:
        steps, values = t.val_series()
        partner = by_seed.get(t.seed, {}).get(steps[-1], math.nan) if steps else math.nan
        if math.isfinite(partner) and math.isfinite(values[-1]):
            cell[t.seed], base[t.seed] = values[-1], partner
    return ratio_interval(cell, base, labels=(label, BASELINE)) if cell else None


def _short_text(label: str, short: dict[int, tuple[int, str]], steps: int) -> str:
    reached = min(step for step, _ in short.values())
    why = ", ".join(sorted({w for _, w in short.values()}))
    return (f"{label} seed{'s' if len(short) > 1 else ''} {seeds_text(short)} evaluated only up to step "
            f"{reached} of the cell's {steps} ({why}), left out")


def _sweet_spot(cells: list[Cell], precision: str, optimizer: str, axes: AxesKey) -> SweetSpot:
    """The leader and its tie group among the eligible cells and bf16 (see DEFINITIONS)."""
    eligible = [c for c in cells if c.own_full_run and math.isfinite(c.ratio.mean)]
    excluded = tuple(c.name for c in cells if c not in eligible)
    n = max((c.ratio.n for c in eligible), default=0)
    entries = [(c.name, c.ratio) for c in eligible]
    if entries:
        entries.append((BASELINE, Interval(1.0, 0.0, n)))  # bf16 against itself: exactly 1
    group = tuple(leader_group(entries))
    by_name = {c.name: c for c in eligible}
    leader = by_name.get(group[0]) if group else None
    # the × bf16 calls the sweet spot rests on: the "worse" of every eligible cell bf16 leaves out
    # when it leads (alone or in a tie), the leader's own "better" when a format leads alone; a tie
    # a format leads rests on overlaps with it, no call against bf16
    calls = ([c for c in eligible if c.name not in group] if leader is None
             else [leader] if len(group) == 1 else [])
    unheld = tuple(c.name for c in calls if not holds(c.family_wise))
    no_interval = tuple(name for name, e in entries if name in group and e.half_width is None)
    apart = _tie_and_bf16([c for c in eligible if c.name in group], leader) if len(group) > 1 else ()
    twins = tuple((c.name, c.twin_of) for c in eligible if c.twin_of)
    return SweetSpot(precision, optimizer, axes, group, leader, excluded, unheld, no_interval, apart, twins)


def _tie_and_bf16(tied: list[Cell], leader: Cell | None) -> tuple[str, ...]:
    """Where a tie's cells and bf16 part (see `SweetSpot.apart`). `leader` is None when bf16 leads,
    so it is in the tie."""
    def call(c: Cell) -> str:
        return f"{c.name} {c.vs_bf16} than {BASELINE}" + ("" if holds(c.family_wise) else ", not family-wise")

    if leader is None or not leader.ratio.called:  # bf16 is one of the tie
        return tuple(f"yet {call(c)}" for c in tied if c.ratio.called)
    level = [c.name for c in tied if c.ratio.bounded and not c.ratio.called]
    return (f"{BASELINE} left out: {call(leader)}",
            *([f"yet {', '.join(level)} indistinguishable from {BASELINE}"] if level else []))


def _baseline_overrides(bf16: dict[str, list[TrialRecord]], optimizer: str) -> dict[str, Any]:
    """The settings bf16 of `optimizer` ran with beyond the base's (`grid.format_overrides`), {} for none."""
    return next((t.overrides for t in bf16.get(optimizer, []) if t.overrides), {})


def _verdict(cells: dict[tuple[str, str, str, AxesKey], Cell], bf16: dict[str, list[TrialRecord]],
             axes_order: dict[AxesKey, int]) -> Verdict:
    candidates = [c for c in cells.values() if c.format == VERDICT_FORMAT or VERDICT_FORMAT in c.also]
    if not bf16:
        return Verdict(False, None, f"no {BASELINE} baseline with a finite loss")
    if not candidates:
        return Verdict(False, None, f"no {VERDICT_FORMAT} trial")
    named = [c for c in candidates if (c.precision, c.optimizer) == (VERDICT_PRECISION, STANDARD)]
    pool = named or [c for c in candidates if c.own_full_run] or candidates
    cell = min(pool, key=lambda c: (c.precision != VERDICT_PRECISION, c.optimizer != STANDARD,
                                    axes_order.get(c.axes, 0)))
    where = " / ".join(x for x in (cell.name, cell.precision_label, cell.optimizer, axes_text(cell.axes)) if x)
    if cell.overrides:
        where += f" (with {overrides_text(cell.overrides)})"
    if base := _baseline_overrides(bf16, cell.optimizer):
        where += f", against {BASELINE} with {overrides_text(base)}"
    if cell.broke:
        return Verdict(False, cell, f"{where} stopped: {', '.join(cell.stops)}")
    if cell.shifted:
        return Verdict(False, cell, f"{where}: {cell.shift_text}, so its numbers are not "
                                    f"{VERDICT_FORMAT}'s alone")
    if cell.running:
        behind = {t.seed: last_eval(t) or 0 for t in cell.trials if t.status in UNFINISHED}
        state = " / ".join(dict.fromkeys(unfinished_text(t.status) for t in cell.trials if t.status in UNFINISHED))
        return Verdict(False, cell, f"{where} {state} (seed{'s' if len(behind) > 1 else ''} "
                                    f"{seeds_text(behind)} evaluated up to step {min(behind.values())}): "
                                    "no verdict on a partial budget")
    if not cell.full_budget:
        return Verdict(False, cell, f"{where} cut before the full budget (step {cell.steps}): no verdict on "
                                    "a partial budget")
    if cell.no_baseline:
        return Verdict(False, cell, f"{where}: {cell.no_baseline}")
    if not math.isfinite(cell.ratio.mean):
        return Verdict(False, cell, f"{where} has no finite val loss")
    if cell.ratio.half_width is None:
        return Verdict(False, cell, f"{where}: n = {cell.ratio.n}, no interval: a single seed cannot "
                                    "establish it")
    limit = 1 + VERDICT_TOLERANCE
    passed = cell.ratio.hi <= limit
    how = (f"the whole interval is at or below {limit:.2f}" if passed else
           f"the interval reaches {beside(cell.ratio.hi, limit, 3)} > {limit:.2f}")
    return Verdict(passed, cell, f"{where}, {cell.steps} steps, {cell.ratio.n} seeds: {how}")


def _missing(records: list[TrialRecord], given: list[str]) -> list[str]:
    """Grid points the caller knows never started, unfinished trials, unreadable trial files."""
    out = list(given)
    out += [f"{name(r)} ({label(r)}): unreadable: {r.unreadable}" for r in records if r.unreadable]
    for r in records:
        if r.status in UNFINISHED and name(r) not in given and not r.same_as:
            step = stop_step(r)[0]
            state = ("not started" if r.status == TrialStatus.PENDING else f"{unfinished_text(r.status)}, no step "
                     "reported yet" if step is None else f"{unfinished_text(r.status)} at step {step}, numbers provisional")
            out.append(f"{name(r)} ({label(r)}): {state}")
    return list(dict.fromkeys(out))


def _difference(what: str, a: Cell, b: Cell) -> Difference | None:
    """b − a per seed over their full budgets; None when either did not run it."""
    if not (a.full_budget and b.full_budget):
        return None
    diff = difference_interval(seed_values(b.trials), seed_values(a.trials), labels=(b.name, a.name))
    return Difference(what, a, b, diff)


def _fidelity(cell: Cell, bf16: list[TrialRecord]) -> GradientFidelity | None:
    """The cell's gradient cosine against bf16's, each seed over the steps its trial ran up to its
    stop (a collapse: its first non-finite step) and the cell's steps, on both sides, over the
    seeds its loss numbers use; its non-finite shadow steps counted up to the last step it logged
    (a collapsed run goes on logging them). None when none of its trials logged a shadow step."""
    trials = [t for t in cell.trials if t.seed not in cell.short]

    def upto(t: TrialRecord, last: int | None) -> int:
        return cell.steps if last is None else min(cell.steps, last)

    logged = [shadow_cosines(t, upto(t, last_logged_step(t))) for t in trials]
    if not any(logged):
        return None
    ran = {t.seed: upto(t, stop_step(t)[0]) for t in trials}  # (where the means are compared)
    values = {t.seed: gradient_cosine(t, ran[t.seed]) for t in trials}
    base = {t.seed: gradient_cosine(t, ran.get(t.seed, cell.steps)) for t in baseline_trials(bf16, cell.axes)
            if t.seed not in cell.short_baseline}
    diff = difference_interval(values, base, labels=(cell.name, BASELINE))
    if diff.paired:  # bf16's column over the seeds the difference pairs it on
        base = {s: v for s, v in base.items() if math.isfinite(v) and math.isfinite(values.get(s, math.nan))}
    return GradientFidelity(cell, mean_interval(values.values()), mean_interval(base.values()), diff,
                            nonfinite=sum(not math.isfinite(v) for vs in logged for v in vs),
                            shadow_steps=sum(map(len, logged)))


def compute_findings(records: list[TrialRecord], missing: list[str] | None = None) -> Findings:
    """All findings of an experiment; `missing` names grid points that never started."""
    started = [r for r in records if r.status != TrialStatus.PENDING or r.history]
    measured = [r for r in started if not r.same_as]
    quantized = [r for r in measured if r.format != BASELINE]
    by_key = {r.key: r for r in measured}
    # an alias of another format is listed under the measured format's cells ("e0m7 ≡ e1m6"); one of
    # another precision, the same format, is a cell of its own precision (`Cell.twin_of`)
    own = {r.format for r in measured}  # (a format measured anywhere has cells of its own)
    aliases = {r.format: by_key[r.same_as].format for r in started
               if r.same_as in by_key and by_key[r.same_as].format != r.format and r.format not in own}
    twins = [r for r in started if r.same_as in by_key and by_key[r.same_as].format == r.format]
    twin_of = {(r.format, r.optimizer, r.precision, axes_key(r)): by_key[r.same_as].precision for r in twins}
    twin_ids = {id(r) for r in twins}
    celled = [r for r in started if r.format != BASELINE and (not r.same_as or id(r) in twin_ids)]  # grid order
    formats = _ordered([*(r.format for r in celled), *aliases], key=format_key)
    optimizers = _ordered(r.optimizer for r in measured)
    precisions = _ordered(r.precision for r in (celled or measured))
    axes = tuple(dict.fromkeys(axes_key(r) for r in celled))
    axes_order = {ax: i for i, ax in enumerate(axes)}
    notes: list[str] = _overrides_note(started)
    notes += [f"{fmt} / {precision} quantizes the same layers in the same formats as {fmt} / {measured_by}: one "
              "measurement (the latter's trials), listed under both; each comparison counts once in its Holm family."
              for fmt, precision, measured_by in dict.fromkeys((k[0], k[2], m) for k, m in twin_of.items())]
    bf16, lent = _baselines(measured, optimizers, notes)
    baseline_name, compute_notes = _baseline_compute([t for trials in bf16.values() for t in trials])
    notes += compute_notes

    cells: dict[tuple[str, str, str, AxesKey], Cell] = {}
    for key in sorted({(r.format, r.optimizer, r.precision, axes_key(r)) for r in celled}):
        trials = tuple(r for r in celled if (r.format, r.optimizer, r.precision, axes_key(r)) == key)
        also = tuple(sorted((a for a, m in aliases.items() if m == key[0]), key=format_key))
        cells[key] = replace(_make_cell(key, trials, bf16.get(key[1], []), also), twin_of=twin_of.get(key, ""))
    cells = dict(zip(cells, _with_family_wise(list(cells.values()), left_out=lambda c: not c.compared,
                                              measured=lambda c: c.ratio, key=lambda c: c.measurement),
                     strict=True))  # the × bf16 family

    spots = []
    for p in precisions:
        for o in optimizers:
            for ax in axes:
                group = [c for c in cells.values() if (c.precision, c.optimizer, c.axes) == (p, o, ax)]
                if group:
                    spots.append(_sweet_spot(group, p, o, ax))

    failures = []
    for r in sorted(measured, key=lambda r: (format_key(r.format), r.optimizer, r.precision, r.seed)):
        reason = r.stop_reason
        step, collapsed = stop_step(r)
        if reason in (None, StopReason.COMPLETED) and not collapsed:
            continue
        where, evidence = failure_site(r)
        if r.stop_detail:
            evidence = f"{r.stop_detail}; {evidence}"
        if r.error:
            evidence += f"; error: {r.error}"
        failures.append(Failure(r, step, collapsed, reason or "—", where, evidence))

    notes += [f"**Emergency format shifts**, {label(r)}{' / ' + axes_text(axes_key(r)) if r.axes else ''} "
              f"seed {r.seed}: {shifts_text(r)}. " + (
                  f"Its cell's numbers are not {r.format}'s alone; the cell is left out of the sweet spot "
                  "and the verdict." if r.shifted_before_eval else
                  "No evaluation came after it, so nothing the run measured changed; the cell stands.")
              for r in quantized if r.format_shifts]
    deltas = _with_family_wise([d for (f, o, p, ax), c in cells.items() if o == STANDARD
                                and (m := cells.get((f, MANIFOLD, p, ax))) is not None
                                and (d := _difference(f"{MANIFOLD} − {STANDARD}", c, m)) is not None])
    notes += [_better_than_bf16(c, c.optimizer in lent, deltas,
                                _baseline_overrides(bf16, c.optimizer))
              for c in cells.values() if c.full_budget and c.vs_bf16 == "better" and not c.twin_of]
    fidelity = [g for c in cells.values() if (g := _fidelity(c, bf16.get(c.optimizer, []))) is not None]
    return Findings(formats, optimizers, precisions, axes, bf16, cells, aliases, spots, failures,
                    deltas, _with_family_wise(_axis_effects(cells, axes)),
                    replace(_verdict(cells, bf16, axes_order), baseline=baseline_name),
                    _missing(records, missing or []), notes,
                    _with_family_wise(fidelity, left_out=lambda g: not g.compared),
                    warnings_raised([*measured, *twins]))  # (a twin's under its own precision too)


def _measurements(d: Difference | GradientFidelity) -> tuple[Any, ...]:
    """What a difference or a gradient comparison compares: the measurements of its cells."""
    if isinstance(d, GradientFidelity):
        return (d.cell.measurement,)
    return d.what, d.a.measurement, d.b.measurement


def _with_family_wise(diffs: list[Compared], left_out: Callable[[Compared], bool] = lambda d: False,
                      measured: Callable[[Compared], Comparison] = lambda d: d.diff,
                      key: Callable[[Compared], Any] = _measurements) -> list[Compared]:
    """The comparisons of one table, each with its `FamilyWise` over the table (of the interval
    `measured`, against its null); those `left_out` (not compared) are out of the
    family and have none. Comparisons of one `key` (the trials they compare: a twin cell's are its
    cell's) are one member of the family and share its `FamilyWise`."""
    members: dict[Any, Compared] = {}
    for d in diffs:
        if not left_out(d):
            members.setdefault(key(d), d)
    adjusted = dict(zip(members, family_wise([measured(d) for d in members.values()]), strict=True))
    return [replace(d, family_wise=None if left_out(d) else adjusted[key(d)]) for d in diffs]


def _axis_pairs(cells: dict[tuple[str, str, str, AxesKey], Cell],
                axes: tuple[AxesKey, ...]) -> list[tuple[str, Cell, Cell]]:
    """Per extra axis, each cell at another value with the cell at the axis's first value (in grid
    order), all else equal: (what, first, other)."""
    out = []
    paths = list(dict.fromkeys(path for ax in axes for path, _ in ax))
    for path in paths:
        first = next(dict(ax)[path] for ax in axes if path in dict(ax))
        for (f, o, p, ax), b in cells.items():
            values = dict(ax)
            if values.get(path, first) == first:
                continue
            a = cells.get((f, o, p, tuple(sorted({**values, path: first}.items()))))
            if a is not None:
                out.append((f"{axis_names(paths)[path]}: {axis_value_text(values[path])} − {axis_value_text(first)}", a, b))
    return out


def _axis_effects(cells: dict[tuple[str, str, str, AxesKey], Cell], axes: tuple[AxesKey, ...]) -> list[Difference]:
    """Per extra axis: each value against the axis's first value, where both sides ran the full
    budget (`_difference`)."""
    return [d for what, a, b in _axis_pairs(cells, axes) if (d := _difference(what, a, b))]


def _sides_short(*sides: tuple[str, Cell]) -> str:
    """Why a difference of two cells (each named) is not taken: each side that did not run the
    full budget, with its stops (`adamw: asha; manifold: asha`)."""
    return "; ".join(f"{side}: {', '.join(c.stops) or (RunStatus.RUNNING if c.running else 'short')}"
                     for side, c in sides if not c.full_budget)
