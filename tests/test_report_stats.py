"""The report's uncertainty arithmetic: t quantiles against table values, closed forms and an
independent integration, intervals worked out by hand, paired vs unpaired comparisons, ties, the
p-values the intervals invert and Holm's adjustment of them."""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pytest

from altgrad.report.stats import (
    Comparison,
    FamilyWise,
    Interval,
    beside,
    difference_interval,
    family_wise,
    holm,
    leader_group,
    mean_interval,
    ratio_interval,
    t_cdf,
    t_quantile,
)

# Two-sided 95 % critical values t_{0.975, df} from a printed t table (6 decimals).
TABLE_975 = {1: 12.706205, 2: 4.302653, 3: 3.182446, 4: 2.776445, 5: 2.570582, 10: 2.228139,
             30: 2.042272}
T2, T4 = TABLE_975[2], TABLE_975[4]


@pytest.mark.parametrize("df", sorted(TABLE_975))
def test_t_quantile_matches_the_table(df):
    assert t_quantile(0.975, df) == pytest.approx(TABLE_975[df], abs=1e-6)


def test_t_quantile_other_levels_from_the_table():
    assert t_quantile(0.995, 10) == pytest.approx(3.169273, abs=1e-6)
    assert t_quantile(0.95, 1) == pytest.approx(6.313752, abs=1e-6)
    assert t_quantile(0.9, 5) == pytest.approx(1.475884, abs=1e-6)


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995, 0.9999])
def test_t_quantile_closed_forms(p):
    """df = 1 (Cauchy), 2 and 4 have closed-form quantiles."""
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    alpha = 4 * p * (1 - p)
    q = math.cos(math.acos(math.sqrt(alpha)) / 3) / math.sqrt(alpha)
    assert t_quantile(p, 4) == pytest.approx(2 * math.sqrt(q - 1), rel=1e-9)


@pytest.mark.parametrize("df", [1, 2, 3, 7, 25, 100, 1000, 1.5, 2.75])
@pytest.mark.parametrize("p", [0.9, 0.975, 0.995])
def test_t_quantile_inverts_the_integrated_density(df, p):
    """Simpson's rule over the t density from 0 to the quantile must give p - 1/2: a CDF computed
    without the incomplete beta function the implementation uses."""
    t = t_quantile(p, df)
    x = np.linspace(0.0, t, 20001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    y = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    h = x[1] - x[0]
    integral = h / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum())
    assert integral == pytest.approx(p - 0.5, abs=1e-10)


def test_t_quantile_against_mpmath():
    """mpmath's 30-digit incomplete beta gives the upper tail at the returned quantile; for the t
    distribution a relative tail error r moves t by about r relative (heavy tails: tail ≈ t·pdf)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 30
    for df in [1, 2, 3, 4, 6, 9, 15, 40, 120, 333, 1000, 3.3]:
        for p in [0.55, 0.8, 0.975, 0.999, 0.999999]:
            t, v = mpmath.mpf(t_quantile(p, df)), mpmath.mpf(df)
            tail = mpmath.betainc(v / 2, 0.5, 0, v / (v + t * t), regularized=True) / 2
            assert float(tail) == pytest.approx(1 - p, rel=1e-9), (df, p)


def test_t_quantile_symmetry_and_limits():
    assert t_quantile(0.5, 7) == 0.0
    assert t_quantile(0.025, 5) == pytest.approx(-TABLE_975[5], abs=1e-6)
    assert t_quantile(0.975, 10**6) == pytest.approx(1.959964, abs=1e-5)  # → normal quantile
    assert t_cdf(0.0, 3) == 0.5
    assert t_cdf(TABLE_975[10], 10) == pytest.approx(0.975, abs=1e-7)
    assert t_cdf(-TABLE_975[10], 10) == pytest.approx(0.025, abs=1e-7)
    for bad_p in (0.0, 1.0, -0.1, math.nan):
        with pytest.raises(ValueError):
            t_quantile(bad_p, 3)
    for bad_df in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError):
            t_quantile(0.975, bad_df)


def test_interval_n2_by_hand():
    # mean = (6.50 + 6.60) / 2 = 6.55; deviations ±0.05; s² = 0.005 / (2 - 1) = 0.005;
    # s = 0.0707107; se = s / √2 = 0.05; t_{0.975,1} = 12.706205; half = 12.706205 · 0.05
    e = mean_interval([6.50, 6.60])
    assert (e.n, e.mean) == (2, pytest.approx(6.55))
    assert e.half_width == pytest.approx(0.63531025, abs=1e-6)
    assert e.lo == pytest.approx(6.55 - 0.63531025, abs=1e-6)
    assert e.hi == pytest.approx(6.55 + 0.63531025, abs=1e-6)
    assert e.text() == "6.5500 ± 0.6353 (n = 2)"


def test_interval_n3_by_hand():
    # mean = 2; deviations -1, 0, 1; s² = 2 / 2 = 1; s = 1; se = 1 / √3 = 0.5773503;
    # t_{0.975,2} = 4.302653; half = 4.302653 · 0.5773503 = 2.484138
    e = mean_interval([1.0, 2.0, 3.0])
    assert (e.n, e.mean) == (3, 2.0)
    assert e.half_width == pytest.approx(2.484138, abs=1e-6)
    assert e.text(2) == "2.00 ± 2.48 (n = 3)"


def test_a_narrow_interval_is_printed_with_the_places_its_width_needs():
    """Two seeds' ratios to bf16 agreeing to the fourth place: deviations ±0.00003, s = 0.00003 * √2,
    se = 0.00003, half = 12.7062 * 0.00003 = 0.00038. At 3 places that read '1.000 ± 0.000', an
    interval of no width; it gets a fourth place. A width of exactly 0 still prints as 0, and one
    that shows at 3 places keeps 3."""
    e = mean_interval([1.000296, 1.000356])
    assert e.half_width == pytest.approx(12.7062 * 0.00003, rel=1e-4)
    assert e.text(3) == "1.0003 ± 0.0004 (n = 2)"
    assert mean_interval([1.0, 1.0]).text(3) == "1.000 ± 0.000 (n = 2)"
    assert mean_interval([1.0, 1.2]).text(3) == "1.100 ± 1.271 (n = 2)"


def test_interval_n5_by_hand():
    # mean = 20 / 5 = 4; deviations -2, 0, 0, 1, 1; s² = 6 / 4 = 1.5; se = √(1.5 / 5) = 0.5477226;
    # t_{0.975,4} = 2.776445; half = 2.776445 · 0.5477226 = 1.520722
    e = mean_interval([2.0, 4.0, 4.0, 5.0, 5.0])
    assert (e.n, e.mean) == (5, 4.0)
    assert e.half_width == pytest.approx(1.520722, abs=1e-6)


def test_interval_other_confidence():
    # 0..10: mean 5, s² = 110 / 10 = 11, se = √(11 / 11) = 1; t_{0.995,10} = 3.169273
    e = mean_interval(range(11), confidence=0.99)
    assert e.half_width == pytest.approx(3.169273, abs=1e-6)
    assert e.confidence == 0.99
    for bad in (0.0, 1.0, 95):
        with pytest.raises(ValueError):
            mean_interval([1.0, 2.0], confidence=bad)


def test_one_seed_has_no_interval():
    e = mean_interval([6.5123])
    assert (e.mean, e.half_width, e.n, e.lo, e.hi) == (6.5123, None, 1, None, None)
    assert e.text() == "6.5123 (n = 1, no interval)"


def test_identical_seeds_give_a_zero_width_interval():
    e = mean_interval([3.0, 3.0, 3.0])
    assert (e.mean, e.half_width) == (3.0, 0.0)


def test_non_finite_values_are_left_out_and_not_counted():
    assert mean_interval([1.0, 2.0, math.nan, 3.0, math.inf, -math.inf]) == mean_interval(
        [1.0, 2.0, 3.0])
    assert mean_interval([4.0, math.nan]) == Interval(4.0, None, 1)
    empty = mean_interval([math.nan, math.inf])
    assert empty.n == 0 and math.isnan(empty.mean) and empty.half_width is None
    assert empty.text() == "no finite value (n = 0)"


def test_ratio_paired_by_seed():
    # per-seed ratios 2.2/2, 2.4/2, 2.0/2 = 1.1, 1.2, 1.0: mean 1.1, s = 0.1, se = 0.1 / √3,
    # half = 4.302653 · 0.0577350 = 0.2484138
    r = ratio_interval({1: 2.2, 2: 2.4, 3: 2.0}, {1: 2.0, 2: 2.0, 3: 2.0})
    assert isinstance(r, Comparison)
    assert (r.paired, r.n, r.n_other, r.note) == (True, 3, 3, None)
    assert r.mean == pytest.approx(1.1)
    assert r.half_width == pytest.approx(T2 * 0.1 / math.sqrt(3), abs=1e-6)
    assert r.text() == "1.1000 ± 0.2484 (n = 3, paired)"


def test_pairing_cancels_the_noise_seeds_share():
    base = {1: 2.0, 2: 4.0, 3: 8.0}
    paired = ratio_interval({s: 1.5 * v for s, v in base.items()}, base)
    assert paired.paired and paired.mean == pytest.approx(1.5) and paired.half_width == 0.0
    unpaired = ratio_interval({4: 3.0, 5: 6.0, 6: 12.0}, base)
    assert not unpaired.paired and unpaired.mean == pytest.approx(1.5)
    assert unpaired.half_width > 1.0


def test_ratio_unpaired_when_seed_sets_differ():
    # cell {4, 6}: mean 5, s² = 2, se² = 1; bf16 {2, 3}: mean 2.5, s² = 0.5, se² = 0.25;
    # ratio 2; relative variance 1/25 + 0.25/6.25 = 0.08; se = 2 · √0.08;
    # Welch df = 0.08² / (0.04²/1 + 0.04²/1) = 2, so t = 4.302653
    r = ratio_interval({1: 4.0, 3: 6.0}, {1: 2.0, 2: 3.0})
    assert (r.paired, r.n, r.n_other) == (False, 2, 2)
    assert r.mean == pytest.approx(2.0)
    assert r.half_width == pytest.approx(T2 * 2 * math.sqrt(0.08), abs=1e-6)
    assert r.note == "unpaired: bf16 has seeds {1, 2}, the cell {1, 3}"
    assert r.text(3) == "2.000 ± 2.434 (n = 2 vs 2, unpaired)"


def test_ratio_one_seed_baseline_has_no_interval():
    r = ratio_interval({1: 3.0, 2: 3.2, 3: 3.1}, {1: 3.0})
    assert (r.paired, r.half_width, r.n, r.n_other) == (False, None, 3, 1)
    assert r.mean == pytest.approx(3.1 / 3.0)
    assert r.note == ("unpaired: bf16 has seeds {1}, the cell {1, 2, 3}; "
                      "bf16 has one seed, so no interval")
    assert r.text() == "1.0333 (n = 3 vs 1, unpaired, no interval)"


def test_a_baseline_missing_a_seed_pairs_on_the_seeds_both_have():
    """Unpaired, the cell's extra seed would be set against bf16's mean: with seed-to-seed noise
    several times a format's effect, that can flip the reading (helper-16's mid-run e7m0: 4.5x
    narrower than the paired interval)."""
    r = ratio_interval({1: 2.2, 2: 2.4, 3: 2.0}, {1: 2.0, 2: 2.1}, labels=("e4m3", "bf16"))
    assert (r.paired, r.n) == (True, 2)
    assert r.note == "paired on the seeds both have, {1, 2}: e4m3's {3} left out"
    ratios = [2.2 / 2.0, 2.4 / 2.1]
    assert r.mean == pytest.approx(sum(ratios) / 2)
    assert r.half_width == pytest.approx(TABLE_975[1] * abs(ratios[0] - ratios[1]) / 2, rel=1e-5)


def test_a_diverged_seed_is_left_out_of_the_pairs_and_named():
    r = ratio_interval({1: 2.2, 2: math.nan, 3: 2.0}, {1: 2.0, 2: 2.0, 3: 2.0})
    assert (r.paired, r.n, r.n_other) == (True, 2, 2)
    assert r.note == ("the cell: seed {2} not finite, left out; "
                      "paired on the seeds both have, {1, 3}: bf16's {2} left out")
    # per-seed ratios 1.1 and 1.0: mean 1.05, s = 0.1 / √2, half = t(1) · s / √2 = t(1) · 0.05
    assert r.mean == pytest.approx(1.05)
    assert r.half_width == pytest.approx(TABLE_975[1] * 0.05, rel=1e-5)


def test_one_shared_seed_of_several_compares_the_means():
    r = ratio_interval({1: 4.0, 3: 6.0, 5: 5.0}, {1: 2.0, 2: 3.0})
    assert not r.paired and r.note == "unpaired: bf16 has seeds {1, 2}, the cell {1, 3, 5}"


def test_the_same_seed_lost_on_both_sides_stays_paired():
    r = ratio_interval({1: 2.2, 2: math.inf, 3: 2.0}, {1: 2.0, 2: math.nan, 3: 2.0})
    assert (r.paired, r.n) == (True, 2)
    assert r.note == "the cell: seed {2} not finite, left out; bf16: seed {2} not finite, left out"


def test_ratio_with_no_finite_baseline():
    r = ratio_interval({1: 2.0, 2: 2.1}, {1: math.nan})
    assert math.isnan(r.mean) and r.half_width is None and r.n_other == 0
    assert "bf16 has no finite value, so no interval" in r.note


def test_difference_paired():
    # d = 5-4, 7-5, 6-6 = 1, 2, 0: mean 1, s = 1, half = 4.302653 / √3
    d = difference_interval({1: 5.0, 2: 7.0, 3: 6.0}, {1: 4.0, 2: 5.0, 3: 6.0})
    assert d.paired and d.mean == pytest.approx(1.0)
    assert d.half_width == pytest.approx(T2 / math.sqrt(3), abs=1e-6)


def test_difference_welch():
    # a {4, 6}: mean 5, se² = 2/2 = 1; b {1, 3}: mean 2, se² = 1; df = 2² / (1/1 + 1/1) = 2;
    # half = 4.302653 · √2
    d = difference_interval({1: 4.0, 2: 6.0}, {3: 1.0, 4: 3.0})
    assert not d.paired and d.mean == pytest.approx(3.0)
    assert d.half_width == pytest.approx(T2 * math.sqrt(2), abs=1e-6)
    assert d.note == "unpaired: b has seeds {3, 4}, a {1, 2}"


def test_difference_welch_fractional_df():
    # a: se² = 1; b {2, 3, 2.5}: s² = 0.5 / 2 = 0.25, se² = 1/12; total 13/12;
    # df = (13/12)² / (1/1 + (1/12)²/2) = 1.169557...
    d = difference_interval({1: 4.0, 2: 6.0}, {3: 2.0, 4: 3.0, 5: 2.5})
    df = (13 / 12) ** 2 / (1 + (1 / 12) ** 2 / 2)
    assert d.mean == pytest.approx(2.5)
    assert d.half_width == pytest.approx(t_quantile(0.975, df) * math.sqrt(13 / 12), rel=1e-9)
    assert T2 < t_quantile(0.975, df) < TABLE_975[1]


def test_overlapping_intervals_tie_and_separated_ones_are_ordered():
    e4m3 = Interval(1.000, 0.010, 3)
    bf16 = Interval(1.015, 0.010, 3)
    e5m2 = Interval(1.100, 0.010, 3)
    assert not e4m3.separates(bf16) and not bf16.separates(e4m3)
    assert e4m3.separates(e5m2) and e5m2.separates(e4m3)
    assert leader_group([("bf16", bf16), ("e5m2", e5m2), ("e4m3", e4m3)]) == ["e4m3", "bf16"]


def test_touching_intervals_overlap():
    assert not Interval(1.0, 0.25, 3).separates(Interval(1.5, 0.25, 3))
    assert Interval(1.0, 0.25, 3).separates(Interval(1.5, 0.2, 3))


def test_one_seed_is_never_distinguishable():
    alone = Interval(5.0, None, 1)
    tight = Interval(1.0, 0.001, 5)
    assert not alone.separates(tight) and not tight.separates(alone)
    assert leader_group([("a", tight), ("b", alone)]) == ["a", "b"]
    # a one-seed leader ties with everything, listed in order of mean
    assert leader_group([("c", Interval(3.0, 0.1, 3)), ("lead", Interval(0.5, None, 1)),
                         ("d", Interval(2.0, 0.1, 3))]) == ["lead", "d", "c"]


def test_leader_group_skips_empty_entries_and_accepts_comparisons():
    ratios = [("e3m4", ratio_interval({1: 1.0, 2: 1.1}, {1: 1.0, 2: 1.0})),
              ("lost", ratio_interval({1: math.nan}, {1: 1.0})),
              ("e5m2", ratio_interval({1: 3.0, 2: 3.1}, {1: 1.0, 2: 1.0}))]
    assert leader_group(ratios) == ["e3m4"]
    assert leader_group([("lost", mean_interval([math.nan]))]) == []


# -- p-values and Holm's adjustment -------------------------------------------------------------

def mpmath_two_sided_p(t: float, df: float) -> float:
    """2 P(T > |t|) from mpmath's incomplete beta: independent of the module's own t tail."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 30
    v, t = mpmath.mpf(df), mpmath.mpf(abs(t))
    return float(mpmath.betainc(v / 2, 0.5, 0, v / (v + t * t), regularized=True))


@pytest.mark.parametrize("t", [0.3, 1.0, 2.5, 4.302653, 5.92, 40.0])
def test_p_value_closed_forms(t):
    """With n = 3 (df 2) the two-sided p of t is 1 − t/√(t² + 2); with n = 2 (Cauchy), 1 − (2/π)
    atan(t). The interval's half-width is t_table · se, so se = half-width / t_table."""
    se = 0.01
    three = Interval(1.0 + t * se, TABLE_975[2] * se, 3)
    assert three.p_value(1.0) == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-6)
    two = Interval(-t * se, TABLE_975[1] * se, 2)
    assert two.p_value(0.0) == pytest.approx(1 - 2 / math.pi * math.atan(t), rel=1e-6)


def test_the_one_call_of_the_2026_11_24_study_has_p_0027():
    """The CPU study published 2026-11-24: grad_format e4m3 − e5m2 on e0m7, 0.0227 ± 0.0165 (n =
    3, paired)."""
    c = Comparison(0.0227, 0.0165, 3, paired=True, n_other=3, null=0.0)
    t = 0.0227 / (0.0165 / TABLE_975[2])
    assert c.p_value(0.0) == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-5)
    assert 0.026 < c.p_value(0.0) < 0.028


@pytest.mark.parametrize("seed", range(40))
def test_p_below_005_exactly_when_the_interval_excludes_the_null(seed):
    """Paired ratios and differences, and Welch's unpaired difference, on drawn data: the p-value
    is mpmath's for the t statistic and df computed here from the values, and it is below 0.05
    exactly when the 95 % interval excludes the null."""
    rng = np.random.default_rng(seed)
    n, shift = int(rng.integers(2, 7)), float(rng.normal(0, 0.02))
    a = {s: 1.0 + shift + float(rng.normal(0, 0.02)) for s in range(n)}
    b = {s: 1.0 + float(rng.normal(0, 0.02)) for s in range(n)}
    per_seed = np.array([a[s] / b[s] for s in a])
    ratio = ratio_interval(a, b)
    t = (per_seed.mean() - 1) / (per_seed.std(ddof=1) / math.sqrt(n))
    assert ratio.p_value(1.0) == pytest.approx(mpmath_two_sided_p(t, n - 1), rel=1e-7, abs=1e-12)

    b_unpaired = {s + 100: v for s, v in b.items()} | {999: 1.0 + float(rng.normal(0, 0.05))}
    diff = difference_interval(a, b_unpaired)
    xa, xb = np.array(list(a.values())), np.array(list(b_unpaired.values()))
    va, vb = xa.var(ddof=1) / len(xa), xb.var(ddof=1) / len(xb)
    t = (xa.mean() - xb.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(xa) - 1) + vb ** 2 / (len(xb) - 1))
    assert not diff.paired and diff.df == pytest.approx(df, rel=1e-12)
    assert diff.p_value(0.0) == pytest.approx(mpmath_two_sided_p(t, df), rel=1e-7, abs=1e-12)
    for c, null in ((ratio, 1.0), (diff, 0.0)):
        assert (c.p_value(null) < 0.05) == (c.hi < null or c.lo > null)


def test_p_value_without_an_interval_or_spread():
    assert Interval(1.2, None, 1).p_value(1.0) is None
    assert ratio_interval({1: math.nan}, {1: 1.0}).p_value(1.0) is None
    assert ratio_interval({1: 1.1, 2: 1.1}, {1: 1.0, 2: 1.0}).p_value(1.0) == 0.0  # no spread, off the null
    assert difference_interval({1: 2.0, 2: 2.0}, {1: 2.0, 2: 2.0}).p_value(0.0) == 1.0
    unpaired = difference_interval({1: 2.0, 2: 2.0}, {3: 1.0, 4: 1.0})  # no spread on either side
    assert not unpaired.paired and unpaired.half_width == 0.0 and unpaired.p_value(0.0) == 0.0


@pytest.mark.parametrize("seed", range(10))
def test_an_unpaired_ratios_p_is_the_delta_methods(seed):
    """mean(a) / mean(b) against 1 with the delta method's standard error |r| √(se_a²/ā² +
    se_b²/b̄²) and Welch's df, worked out here; the p is mpmath's for that t and df."""
    rng = np.random.default_rng(seed)
    a = {s: 1.05 + float(rng.normal(0, 0.03)) for s in range(int(rng.integers(2, 6)))}
    b = {s + 10: 1.0 + float(rng.normal(0, 0.03)) for s in range(int(rng.integers(2, 6)))}
    xa, xb = np.array(list(a.values())), np.array(list(b.values()))
    r = xa.mean() / xb.mean()
    ua, ub = xa.var(ddof=1) / len(xa) / xa.mean() ** 2, xb.var(ddof=1) / len(xb) / xb.mean() ** 2
    df = (ua + ub) ** 2 / (ua ** 2 / (len(xa) - 1) + ub ** 2 / (len(xb) - 1))
    c = ratio_interval(a, b)
    assert not c.paired and c.df == pytest.approx(df, rel=1e-12)
    assert c.p_value(1.0) == pytest.approx(mpmath_two_sided_p((r - 1) / (r * math.sqrt(ua + ub)), df),
                                           rel=1e-7, abs=1e-12)


def holm_by_closed_testing(ps: list[float]) -> list[float]:
    """Holm's procedure is the closed test of Bonferroni-tested intersections: hypothesis i's
    adjusted p is the largest, over every subset S that contains i, of min(1, |S| · min p over S)."""
    m = len(ps)
    out = []
    for i in range(m):
        worst = 0.0
        for mask in range(1 << m):
            if mask >> i & 1:
                members = [ps[j] for j in range(m) if mask >> j & 1]
                worst = max(worst, min(1.0, len(members) * min(members)))
        out.append(worst)
    return out


def test_holm_textbook_example():
    """Sorted 0.005, 0.01, 0.03, 0.04 (m = 4): × 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 → 0.06 (no
    adjusted p falls below an earlier one); returned in the input order."""
    assert holm([0.04, 0.005, 0.03, 0.01]) == pytest.approx([0.06, 0.02, 0.06, 0.03])
    assert holm([]) == []
    assert holm([0.027]) == [0.027]
    assert holm([0.027] + [0.5] * 6)[0] == pytest.approx(0.189)  # that study's family of 7


@pytest.mark.parametrize("seed", range(30))
def test_holm_equals_the_closed_test_of_bonferroni(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 7))
    ps = [float(p) for p in np.where(rng.random(m) < 0.5, rng.uniform(0, 0.1, m), rng.uniform(0, 1, m))]
    ps += [ps[0]] * int(rng.integers(0, 2))  # ties
    assert holm(ps) == pytest.approx(holm_by_closed_testing(ps), rel=1e-12)


def printed_ends(text: str) -> tuple[Decimal, Decimal]:
    """The interval a reader works out from '1.010 ± 0.010 (n = 3, paired)'."""
    mean, half = (Decimal(x) for x in text.split(" (")[0].split(" ± "))
    return mean - half, mean + half


@pytest.mark.parametrize("spread", [0.00401, 0.00403])
def test_printed_interval_ends_lie_where_the_call_says(spread):
    """At 3 places both of these print '1.010 ± 0.010', whose ends touch 1, yet the first excludes
    1 (lower end 1.00004: 'worse') and the second does not (0.99999): each is printed with the
    places that put its ends on the side of 1 its call reads."""
    ratio = ratio_interval({1: 1.01 - spread, 2: 1.01, 3: 1.01 + spread}, {1: 1.0, 2: 1.0, 3: 1.0})
    lo, hi = printed_ends(ratio.text(3))
    assert (lo > 1) == ratio.excludes(1.0) == (spread < 0.00402)
    assert hi > 1


@pytest.mark.parametrize("seed", range(3))
def test_a_reader_of_the_printed_interval_makes_the_calls_the_report_makes(seed):
    """Random paired ratios and differences, many near their null: from the printed numbers alone
    a reader sees the interval exclude the null exactly where the report calls it, and where it
    does not, an end at or across the null."""
    rng = np.random.default_rng(seed)
    for _ in range(400):
        n = int(rng.integers(2, 6))
        base = {s: float(rng.uniform(5, 8)) for s in range(n)}
        scale = float(rng.uniform(0.999, 1.02))
        cell = {s: v * (scale + float(rng.normal(0, 0.004))) for s, v in base.items()}
        for comparison, null in ((ratio_interval(cell, base), 1), (difference_interval(cell, base), 0)):
            lo, hi = printed_ends(comparison.text(3))
            assert (lo > null or hi < null) == comparison.excludes(null), comparison.text(3)


@pytest.mark.parametrize(("p", "shown"), [(0.0496, "0.0496"), (0.0501, "0.0501"), (0.012, "0.012"),
                                          (0.05, "0.05"), (0.5012, "0.5"), (0.04999, "0.04999")])
def test_a_p_value_is_printed_on_its_side_of_005(p, shown):
    """Two significant digits put 0.0496 at 0.05, where a call that holds reads as one that does
    not; a p is printed with the digits that keep it below 0.05 exactly where it is."""
    text = FamilyWise(p, p, 1, p < 0.05).text
    assert text.endswith(f"p {shown}, Holm {shown} of 1")
    assert (float(shown) < 0.05) == (p < 0.05) == text.startswith("holds: ")


def test_the_family_wise_alpha_is_the_05_the_report_states():
    """1 - 0.95 is 0.05 and 4e-17: a p of exactly 0.05 would hold against it, and print as 'p 0.05'."""
    ratio = ratio_interval({1: 1.01, 2: 1.02, 3: 1.04}, {1: 1.0, 2: 1.0, 3: 1.0})
    (fw,) = family_wise([ratio])
    assert fw.alpha == 0.05 and not FamilyWise(0.05, 0.05, 1, True, fw.alpha).holds


def test_the_verdicts_limit_is_printed_on_its_side():
    """'the interval reaches 1.100 > 1.10' would say a number is above the limit that prints equal to it."""
    assert beside(1.1004, 1.1, 3) == "1.1004" and beside(1.0996, 1.1, 3) == "1.0996"
    assert beside(1.1234, 1.1, 3) == "1.123" and beside(1.1, 1.1, 3) == "1.100"
