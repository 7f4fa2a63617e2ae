"""The uncertainty arithmetic of the report: intervals over seeds, ratios to bf16, ties, and the
correction for making many comparisons at once.

A sweep runs each cell with a handful of seeds, so a mean alone overstates what the report knows;
every number it compares carries a Student-t interval, and two cells are only called different
when their intervals are disjoint. A report reads dozens of such intervals, and at 95 % each about
one in twenty excludes its null by chance alone, so each comparison also has the p-value its
interval inverts and Holm's adjustment of it over the comparisons read beside it (`holm`). Pure functions, no I/O, standard library only (the report must
not need scipy), so every number can be recomputed by hand from the trial data.

Non-finite values (a seed that trained to NaN or inf) are left out everywhere, and `n` counts the
values that remain: an interval over the surviving seeds, never a NaN that poisons the mean.
Whether a seed diverged at all is the failure table's business, not this module's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from statistics import fmean, stdev

from altgrad.precision import BASELINE

__all__ = [
    "Comparison",
    "FamilyWise",
    "Interval",
    "beside",
    "difference_interval",
    "family_wise",
    "holds",
    "holm",
    "interval_ends",
    "leader_group",
    "mean_interval",
    "p_text",
    "ratio_interval",
    "reading",
    "sides_kept",
    "t_cdf",
    "t_quantile",
]

_EPS = 1e-15  # relative convergence of the continued fraction
_MAX_TERMS = 100_000  # enough for df up to ~1e8; the report's df is the number of seeds


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes
    §6.4), which converges quickly for x < (a + 1) / (a + b + 2)."""
    tiny = 1e-300
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    c, h = 1.0, d
    for m in range(1, _MAX_TERMS + 1):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((a + m2 - 1.0) * (a + m2)),
                    -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b})")


def _betainc(a: float, b: float, x: float, y: float) -> float:
    """Regularized incomplete beta I_x(a, b), with y = 1 - x passed in exactly (it is t²/(df+t²)
    for the t distribution, so near x = 1 it keeps its relative precision)."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    log_front = a * math.log(x) + b * math.log(y) - (math.lgamma(a) + math.lgamma(b)
                                                     - math.lgamma(a + b))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, y) / b


def _upper_tail(t: float, df: float) -> float:
    """P(T > t) for t >= 0, computed directly so that small tails keep their precision."""
    t2 = t * t
    return 0.5 * _betainc(df / 2.0, 0.5, df / (df + t2), t2 / (df + t2))


def _t_pdf(t: float, df: float) -> float:
    return math.exp(math.lgamma((df + 1.0) / 2.0) - math.lgamma(df / 2.0)
                    - 0.5 * math.log(df * math.pi) - (df + 1.0) / 2.0 * math.log1p(t * t / df))


def _check_df(df: float) -> None:
    if not (df > 0 and math.isfinite(df)):
        raise ValueError(f"degrees of freedom must be positive and finite, got {df}")


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom (non-integer df allowed: Welch's
    approximation produces them)."""
    _check_df(df)
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = _upper_tail(abs(t), df)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p for Student's t with `df` degrees of freedom (non-integer df
    allowed), accurate to ~1e-9 relative up to df 1e4 (a report's df is seeds - 1, or Welch's); e.g. t_quantile(0.975, 2) = 4.302653, the two-sided 95 %
    critical value of a mean over three seeds.

    Solved by Newton's method on the upper tail, safeguarded by bisection, because the standard
    library has no t distribution and the report must not depend on scipy.
    """
    _check_df(df)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    q = 1.0 - p  # the upper tail to hit; tail(t) decreases from 1/2 at t = 0
    lo, hi = 0.0, 1.0
    while _upper_tail(hi, df) > q:
        lo, hi = hi, 2.0 * hi
    t = 0.5 * (lo + hi)
    for _ in range(200):
        excess = _upper_tail(t, df) - q
        if excess == 0.0:
            return t
        if excess > 0.0:
            lo = t
        else:
            hi = t
        step = excess / _t_pdf(t, df)
        nxt = t + step
        if not lo < nxt < hi:  # Newton left the bracket: bisect instead
            nxt = 0.5 * (lo + hi)
        if abs(nxt - t) <= 1e-13 * nxt or hi - lo <= 1e-13 * hi:
            return nxt
        t = nxt
    return t


def decimals_to_show(half_width: float | None, decimals: int) -> int:
    """`decimals`, or more where a half-width above 0 would print as 0 at that many: enough places
    for its first significant digit. '1.000 ± 0.000' would claim an interval with no width where
    the seeds agree to the fourth place; only a half-width of exactly 0 prints as 0."""
    if not half_width or not math.isfinite(half_width) or half_width >= 0.5 * 10.0 ** -decimals:
        return decimals
    return max(decimals, -math.floor(math.log10(half_width)))


# The most places (or significant digits) `sides_kept` widens a number to.
MOST_DIGITS = 12


def _side(x: float | Decimal, bound: float | Decimal) -> int:
    return (x > bound) - (x < bound)


def sides_kept(shown: Callable[[int], list[str]], values: list[float], bound: float, digits: int) -> int:
    """The fewest digits, from `digits`, at which every printed number (`shown(digits)`: the
    numbers as a reader reads them, e.g. an interval's ends) lies on the same side of `bound` as
    its value, or on it only where the value is: the report calls a difference by which side of a
    null an interval lies, a family-wise call by which side of 0.05 a p lies, and a number printed
    at fewer places can sit on the other side ('1.010 ± 0.010' for an interval that excludes 1 by
    4e-5). `bound` is read as the reader reads it (1.0 as 1, 1 - 0.95 as 0.05)."""
    read = Decimal(format(bound, ".12g"))
    while digits < MOST_DIGITS and any(_side(Decimal(text), read) != _side(v, bound)
                                       for text, v in zip(shown(digits), values, strict=True)):
        digits += 1
    return digits


def interval_ends(mean: float, half_width: float, decimals: int) -> list[str]:
    """The ends of mean ± half_width as a reader works them out from the two printed numbers."""
    m, h = Decimal(f"{mean:.{decimals}f}"), Decimal(f"{half_width:.{decimals}f}")
    return [str(m - h), str(m + h)]


def beside(x: float, bound: float, decimals: int) -> str:
    """x to `decimals` places, or more where fewer would print it on the other side of `bound`
    (or on it): 'the interval reaches 1.1004 > 1.10', not '1.100 > 1.10'."""
    return f"{x:.{sides_kept(lambda d: [f'{x:.{d}f}'], [x], bound, decimals)}f}"


def p_text(p: float, alpha: float) -> str:
    """A p-value to two significant digits, or more where two would print it on the other side
    of `alpha` or on it: 'p 0.0496', not 'p 0.05', for a call that holds."""
    return f"{p:.{sides_kept(lambda k: [f'{p:.{k}g}'], [p], alpha, 2)}g}"


@dataclass(frozen=True)
class Interval:
    """A mean over seeds with its two-sided Student-t interval: mean ± half_width.

    `half_width` is None when there is no interval: with fewer than two values there is no spread
    to estimate, and the report says so rather than printing ± 0. `n` counts finite values only.
    """

    mean: float
    half_width: float | None
    n: int
    confidence: float = 0.95

    @property
    def lo(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def hi(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def separates(self, other: Interval) -> bool:
        """True when both intervals exist and are disjoint: only then are the two called
        different. Without an interval (n < 2) nothing is ever called different: one seed cannot
        tell a real difference from seed noise. Closed intervals: touching ends overlap."""
        if self.half_width is None or other.half_width is None:
            return False
        return self.hi < other.lo or other.hi < self.lo

    @property
    def bounded(self) -> bool:
        """Whether there is an interval to read: a finite estimate with a half-width (n >= 2)."""
        return self.half_width is not None and math.isfinite(self.mean)

    def excludes(self, null: float) -> bool:
        """Whether the interval lies wholly on one side of `null`: the one rule by which the report
        calls a difference a difference."""
        return self.bounded and (self.hi < null or self.lo > null)

    @property
    def df(self) -> float:
        """The degrees of freedom of the t distribution behind the interval."""
        return self.n - 1

    def p_value(self, null: float) -> float | None:
        """Two-sided p of the t test of "the true value is `null`" that the interval inverts: p
        < 1 - confidence when the interval excludes `null` and only then (up to rounding at the
        boundary). None without an interval."""
        if not self.bounded:
            return None
        if self.half_width == 0.0:  # no spread at all: either exactly the null or certainly not
            return 1.0 if self.mean == null else 0.0
        se = self.half_width / t_quantile(_check_confidence(self.confidence), self.df)
        return min(1.0, 2.0 * t_cdf(-abs(self.mean - null) / se, self.df))

    def _counts(self) -> str:
        return f"n = {self.n}"

    def text(self, decimals: int = 4) -> str:
        """'6.5123 ± 0.0412 (n = 3)', '6.5123 (n = 1, no interval)', or for no finite value at all
        'no finite value (n = 0)'; both numbers to `decimals` places, or more where the half-width
        needs them (`decimals_to_show`)."""
        if self.n == 0:
            return f"no finite value ({self._counts()})"
        if self.half_width is None:
            return f"{self.mean:.{decimals}f} ({self._counts()}, no interval)"
        d = self.places(decimals)
        return f"{self.mean:.{d}f} ± {self.half_width:.{d}f} ({self._counts()})"

    def places(self, decimals: int) -> int:
        """The places `text` prints mean and half-width to, at least `decimals`
        (`decimals_to_show`); every printer of the interval uses them."""
        return decimals_to_show(self.half_width, decimals)


@dataclass(frozen=True, kw_only=True)
class Comparison(Interval):
    """A comparison of two sets of seeds (`mean` is the ratio or the difference) with its interval.

    `paired`: the interval is over per-seed ratios/differences on the seeds both sides have (the
    seed-to-seed noise both share cancels); otherwise the sides were compared unpaired, `n` is the
    first side's count, `n_other` the second's, and `note` says why (for the report to print).
    `note` also names seeds left out for non-finite values.
    """

    paired: bool
    n_other: int
    note: str | None = None
    welch_df: float | None = None  # unpaired: the Welch–Satterthwaite degrees of freedom
    null: float  # no effect: 1 for a ratio, 0 for a difference

    @property
    def called(self) -> bool:
        """Whether the interval excludes no effect: the report then calls the two sides different."""
        return self.excludes(self.null)

    def places(self, decimals: int) -> int:
        """Enough places, too, that the ends a reader works out from the printed numbers lie on the
        sides of the null that the call reads (`sides_kept`)."""
        d = super().places(decimals)
        if not self.bounded or not math.isfinite(self.half_width):
            return d
        return sides_kept(lambda k: interval_ends(self.mean, self.half_width, k), [self.lo, self.hi], self.null, d)

    @property
    def df(self) -> float:
        """n - 1 paired, else Welch's df, which an unpaired comparison without spread (half-width
        0: its p is 0 or 1) or without an interval lacks."""
        if self.paired:
            return self.n - 1
        if self.welch_df is None:
            raise ValueError("an unpaired comparison without spread has no Welch df")
        return self.welch_df

    def _counts(self) -> str:
        if self.paired:
            return f"n = {self.n}, paired"
        return f"n = {self.n} vs {self.n_other}, unpaired"


def _check_confidence(confidence: float) -> float:
    """The upper quantile level of a two-sided interval at `confidence`."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    return (1.0 + confidence) / 2.0


def mean_interval(values: Iterable[float], confidence: float = 0.95) -> Interval:
    """The mean of the finite `values` with its Student-t interval: t_{(1+c)/2, n-1} · s / √n,
    s the sample standard deviation (n - 1). Non-finite values are left out and not counted."""
    level = _check_confidence(confidence)
    finite = [float(v) for v in values if math.isfinite(v)]
    n = len(finite)
    if n == 0:
        return Interval(math.nan, None, 0, confidence)
    if n == 1:
        return Interval(finite[0], None, 1, confidence)
    se = stdev(finite) / math.sqrt(n)
    return Interval(fmean(finite), t_quantile(level, n - 1) * se, n, confidence)


def seeds_text(seeds: Iterable[int]) -> str:
    """A set of seeds as the report writes it: {0, 1, 2}."""
    return "{" + ", ".join(str(s) for s in sorted(seeds)) + "}"


def _split(values: Mapping[int, float]) -> tuple[dict[int, float], list[int]]:
    """The finite values by seed, and the seeds left out for non-finite values."""
    finite = {s: float(v) for s, v in values.items() if math.isfinite(v)}
    return finite, [s for s in values if s not in finite]


def _left_out(sides: Iterable[tuple[str, list[int]]]) -> list[str]:
    return [f"{label}: seed{'s' if len(dropped) > 1 else ''} {seeds_text(dropped)} not finite, left out"
            for label, dropped in sides if dropped]


# The fewest shared seeds a comparison pairs on when the sides' seed sets differ (fewer: the
# two means, unpaired). Pairing on two cancels the seed-to-seed noise both sides share, which on
# this bench's losses is several times the formats' effects; one shared seed gives no interval.
MIN_PAIRED = 2


def _compare(a: Mapping[int, float], b: Mapping[int, float], confidence: float,
             labels: tuple[str, str], ratio: bool) -> Comparison:
    """The shared logic of `ratio_interval` and `difference_interval`: pair by seed on the finite
    seeds both sides have when those are all of them or at least `MIN_PAIRED`, else compare the
    two means unpaired (Welch)."""
    level = _check_confidence(confidence)
    null = 1.0 if ratio else 0.0
    (xa, dropped_a), (xb, dropped_b) = _split(a), _split(b)
    la, lb = labels
    left_out = _left_out(((la, dropped_a), (lb, dropped_b)))
    shared = [s for s in xa if s in xb]
    if xa.keys() == xb.keys() or len(shared) >= MIN_PAIRED:
        per_seed = [xa[s] / xb[s] if ratio else xa[s] - xb[s] for s in shared]
        est = mean_interval(per_seed, confidence)
        unmatched = [f"{label}'s {seeds_text(extra)}" for label, x in ((la, xa), (lb, xb))
                     if (extra := [s for s in x if s not in shared])]
        if unmatched:
            left_out.append(f"paired on the seeds both have, {seeds_text(shared)}: "
                            f"{' and '.join(unmatched)} left out")
        return Comparison(est.mean, est.half_width, est.n, confidence, paired=True,
                          n_other=est.n, note="; ".join(left_out) or None, null=null)

    na, nb = len(xa), len(xb)
    notes = [f"unpaired: {lb} has seeds {seeds_text(xb)}, {la} {seeds_text(xa)}", *left_out]
    notes += [f"{label} has {'no finite value' if n == 0 else 'one seed'}, so no interval"
              for label, n in ((la, na), (lb, nb)) if n < 2]
    note = "; ".join(notes)
    if na == 0 or nb == 0:
        return Comparison(math.nan, None, na, confidence, paired=False, n_other=nb, note=note, null=null)
    ma, mb = fmean(xa.values()), fmean(xb.values())
    est = ma / mb if ratio else ma - mb
    if na < 2 or nb < 2:  # one side's spread is unknown: an interval from the other alone lies
        return Comparison(est, None, na, confidence, paired=False, n_other=nb, note=note, null=null)
    # Variance components of the estimate: squared standard errors, relative ones for a ratio
    # (delta method: var(A/B)/(A/B)² ≈ se_A²/A² + se_B²/B²).
    ua = stdev(xa.values()) ** 2 / na / (ma * ma if ratio else 1.0)
    ub = stdev(xb.values()) ** 2 / nb / (mb * mb if ratio else 1.0)
    total = ua + ub
    if total == 0.0:
        return Comparison(est, 0.0, na, confidence, paired=False, n_other=nb, note=note, null=null)
    df = total * total / (ua * ua / (na - 1) + ub * ub / (nb - 1))  # Welch–Satterthwaite
    se = abs(est) * math.sqrt(total) if ratio else math.sqrt(total)
    return Comparison(est, t_quantile(level, df) * se, na, confidence, paired=False, n_other=nb,
                      note=note, welch_df=df, null=null)


def ratio_interval(cell: Mapping[int, float], baseline: Mapping[int, float],
                   confidence: float = 0.95,
                   labels: tuple[str, str] = ("the cell", BASELINE)) -> Comparison:
    """A cell's loss relative to the baseline's (seed -> value maps), with its interval.

    Same finite seeds on both sides, or at least `MIN_PAIRED` in common: the mean of the per-seed
    ratios x_s / b_s over those seeds with their t interval, because seed s fixes the data order
    and initialisation of both runs, and pairing cancels that shared noise (a note names the
    seeds left without a partner). Otherwise (disjoint seeds, a one-seed baseline):
    mean(x) / mean(b) with the delta-method interval (relative variance se_x²/mean_x² +
    se_b²/mean_b², Welch–Satterthwaite df), or none where a side has one seed (its spread is
    unknown), and a note naming both seed sets (`labels` name the cell and the baseline in it). Baseline values must be nonzero (losses are).
    """
    return _compare(cell, baseline, confidence, labels, ratio=True)


def difference_interval(a: Mapping[int, float], b: Mapping[int, float], confidence: float = 0.95,
                        labels: tuple[str, str] = ("a", "b")) -> Comparison:
    """a − b (seed -> value maps) with its interval: the t interval of per-seed differences on
    the seeds both have (as `ratio_interval` pairs), else Welch's unpaired interval, with a note
    naming the seed sets (`labels` name a and b in it)."""
    return _compare(a, b, confidence, labels, ratio=False)


def leader_group(estimates: Iterable[tuple[str, Interval]]) -> list[str]:
    """The names that cannot be told apart from the best (lowest mean: losses, ratios to bf16),
    the leader first, then in order of mean; equal means keep their input order.

    An entry joins the leader unless its interval is disjoint from the leader's, so an entry
    without an interval (one seed) always joins, and a one-seed leader ties with everything:
    the report's "tie: e3m4 ≈ e4m3 ≈ bf16". Entries with no finite value (n = 0) are skipped.
    """
    ranked = sorted(((name, e) for name, e in estimates if not math.isnan(e.mean)),
                    key=lambda item: item[1].mean)
    if not ranked:
        return []
    leader = ranked[0][1]
    return [name for name, e in ranked if not e.separates(leader)]


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values, in their input order.

    The i-th smallest p is multiplied by the number of hypotheses not yet rejected (m - i + 1),
    capped at 1, and made no smaller than the adjusted p before it. Rejecting where the adjusted p
    is below alpha keeps the chance of any false call in the family at most alpha, whatever the
    dependence between the comparisons (they share bf16's seeds), and rejects everything
    Bonferroni's m * p does and more.
    """
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [math.nan] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


@dataclass(frozen=True)
class FamilyWise:
    """A comparison's two-sided p against its null, and Holm's adjustment of it over its family
    (`holm`): whether a call made at 95 % survives the report's making many."""

    p: float
    adjusted: float
    family: int  # the comparisons in the family that have an interval
    called: bool  # the interval excludes the null (`Interval.excludes`)
    alpha: float = 0.05

    @property
    def holds(self) -> bool:
        return self.called and self.adjusted < self.alpha

    @property
    def text(self) -> str:
        """'holds: p 0.0012, Holm 0.0096 of 8', 'not family-wise: p 0.027, Holm 0.19 of 7', or for
        no call 'p 0.41, Holm 1 of 7'."""
        numbers = f"p {p_text(self.p, self.alpha)}, Holm {p_text(self.adjusted, self.alpha)} of {self.family}"
        if not self.called:
            return numbers
        return f"{'holds' if self.holds else 'not family-wise'}: {numbers}"


def holds(fw: FamilyWise | None) -> bool:
    """Whether a comparison's call holds family-wise; one without an interval (None) makes none."""
    return fw is not None and fw.holds


def family_wise(comparisons: list[Comparison]) -> list[FamilyWise | None]:
    """`FamilyWise` of each comparison of one family (against its null), Holm over those with an
    interval; None for a comparison without one."""
    ps = [c.p_value(c.null) for c in comparisons]
    adjusted = iter(holm([p for p in ps if p is not None]))
    m = sum(p is not None for p in ps)
    # alpha as the report states it: 1 - 0.95 is 0.05 and 4e-17
    return [None if p is None else FamilyWise(p, next(adjusted), m, c.called, round(1 - c.confidence, 12))
            for p, c in zip(ps, comparisons, strict=True)]


def reading(estimate: Comparison, below: str, above: str) -> str:
    """`below` / `above` when the 95 % interval excludes no effect on that side
    (`Comparison.called`, the one rule by which the report calls a difference a difference), else
    "indistinguishable"; without an interval (one seed) nothing was tested, which is not the same
    as a tie."""
    if math.isnan(estimate.mean):
        return "not compared (no finite value)"
    if not estimate.bounded:
        return "not tested (no interval)"
    if not estimate.called:
        return "indistinguishable"
    return below if estimate.hi < estimate.null else above
