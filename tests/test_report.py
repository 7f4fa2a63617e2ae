"""The report: findings from synthetic trials with a known answer, the plotted data, report.md."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest

from altgrad.config import RunConfig, StabilityConfig, dump_config
from altgrad.experiment import (
    RUN_DIR,
    STATE_DIR,
    SWEEP_FILE,
    TRIALS_DIR,
    TRIALS_FILE,
    WORKER_FILE,
    TrialRecord,
    load_experiment,
)
from altgrad.report import cli, compute_findings, write_report
from altgrad.report.plots import plot_heatmap, plot_loss, plot_stability, ratio_norm

ROOT = Path(__file__).resolve().parents[1]

STEPS, EVAL = 60, 10


def curve(step: int, scale: float) -> float:
    return scale * (3.0 + 7.0 * math.exp(-step / 15))


def trial(
    fmt: str,
    opt: str = "adamw",
    prec: str = "all",
    scale: float = 1.0,
    seed: int = 0,
    nan_from: int | None = None,
    status: str = "TERMINATED",
    steps: int = STEPS,
    summary: dict | None = None,
    cos: float | None = 0.99,
    **signals: float,
) -> TrialRecord:
    """A trial whose val loss is `scale` × a fixed curve; from `nan_from` on the loss is NaN and
    the forward overflow rate ramps up before it. At each evaluation the FP32 shadow's gradient
    cosine is `cos` - step / 1e4 (None: no shadow). `signals` are extra constant metrics."""
    history, best = [], math.inf
    for step in range(1, steps + 1):
        broken = nan_from is not None and step >= nan_from
        ramp = 0.0 if nan_from is None else max(0.0, 0.05 * (step - nan_from + 5))
        row = {
            "step": step,
            "train/loss": math.nan if broken else curve(step, scale),
            "quant/overflow_rate": 0.001 + ramp,
            "quant/bit_stall_rate": 0.1 + step / 1000,
            "stability/loss_is_nan": float(broken),
            **signals,
        }
        if step % EVAL == 0 or step == 1:
            val = math.inf if broken else curve(step, scale)
            best = min(best, val)
            shadow = {} if cos is None else {"shadow/cos_mean": cos - step / 1e4}
            history.append({**row, "val/loss": val, "val/step": step, **shadow})
        else:
            history.append(
                {**row, "val/loss": history[-1]["val/loss"], "val/step": history[-1]["val/step"]}
            )
    stop = "nan" if nan_from is not None else "completed"
    return TrialRecord(
        trial_id=f"{fmt}_{opt}_{prec}_{seed}",
        format=fmt,
        optimizer=opt,
        precision=prec,
        seed=seed,
        status=status,
        stop_reason=stop if status == "TERMINATED" else None,
        history=history,
        summary={
            "best_val_loss": best,
            "stop_reason": stop if status == "TERMINATED" else None,
            "steps": steps,
            **(summary or {}),
        },
    )


BF16_BEST = curve(STEPS, 1.0)
def seeded(fmt: str, scales: list[float], opt: str = "adamw", prec: str = "all", **kw) -> list[TrialRecord]:
    """One trial per seed 0, 1, 2, ... with the given val-loss scales (= per-seed ratios to bf16)."""
    return [trial(fmt, opt, prec, scale, seed=seed, **kw) for seed, scale in enumerate(scales)]


def hand_interval(values: list[float]) -> tuple[float, float]:
    """mean and 95 % half-width, written out: t(0.975, 2) = 4.302653 for three values."""
    assert len(values) == 3
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    return mean, 4.302653 * sd / math.sqrt(3)


def study() -> list[TrialRecord]:
    """Three seeds per cell. all/adamw: e4m3 overlaps bf16 (a tie), e5m2 separates (worse);
    mlp/adamw: e3m4 separates below bf16 (a real sweet spot), e2m5 overlaps e3m4 (a tie)."""
    return [
        *seeded("bf16", [1.0, 1.0, 1.0]),
        *seeded("e4m3", [1.00, 1.02, 1.04]),
        *seeded("e5m2", [1.20, 1.21, 1.22]),
        *seeded("e3m4", [0.90, 0.91, 0.92], prec="mlp"),
        *seeded("e2m5", [0.91, 0.93, 0.95], prec="mlp"),
        *seeded("e6m1", [1.30, 1.31, 1.32], prec="mlp"),
    ]


def spot(f, precision: str, optimizer: str = "adamw"):
    return next(s for s in f.sweet_spots if (s.precision, s.optimizer) == (precision, optimizer))


def test_one_seed_ties_for_want_of_intervals_not_because_they_overlap():
    """With one seed nothing has an interval, so everything ties with the leader; the report must
    not claim that intervals overlap. A cell with an interval beside one without says both."""
    one = compute_findings([trial("bf16"), trial("e4m3", scale=0.98), trial("e5m2", scale=1.01)])
    assert spot(one, "all").text == "tie: e4m3 ≈ bf16 ≈ e5m2 (no interval for e4m3, e5m2: not tested)"
    mixed = compute_findings([*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e4m3", [0.98, 0.99, 1.0]),
                              *seeded("e3m4", [0.99, 1.0, 1.01]), trial("e5m2", seed=0, scale=0.97)])
    assert spot(mixed, "all").text == \
        "tie: e5m2 ≈ e4m3 ≈ e3m4 ≈ bf16 (intervals overlap; no interval for e5m2: not tested)"


def test_a_tie_says_which_of_its_members_bf16_s_interval_separates():
    """Overlap with the leader is not transitive: e7m0 ties with e4m3, which ties with bf16, while
    e7m0's own × bf16 excludes 1. The tie says so, with whether the call holds family-wise, rather
    than read as every member equal to bf16 (the CPU study's tie named e7m0 beside bf16 while its
    table called e7m0 worse)."""
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e4m3", [0.985, 0.995, 1.005]),
               *seeded("e7m0", [1.006, 1.008, 1.010])]
    f = compute_findings(records)
    e7m0 = f.cells["e7m0", "adamw", "all", ()]
    assert e7m0.vs_bf16 == "worse" and e7m0.family_wise.holds  # p 0.01 of 2 (Holm 0.02)
    assert spot(f, "all").text == "tie: e4m3 ≈ bf16 ≈ e7m0 (intervals overlap; yet e7m0 worse than bf16)"
    records[-1:] = [trial("e7m0", seed=2, scale=1.011)]  # p 0.03 of 2: called, not family-wise
    f = compute_findings(records)
    assert f.cells["e7m0", "adamw", "all", ()].vs_bf16 == "worse"
    assert not f.cells["e7m0", "adamw", "all", ()].family_wise.holds
    assert spot(f, "all").text.endswith("(intervals overlap; yet e7m0 worse than bf16, not family-wise)")


def test_a_tie_without_bf16_says_which_call_left_it_out_and_who_bf16_does_not_separate():
    """The leader's interval excludes 1, so bf16 is out of the tie; e7m0 is in it (it overlaps the
    leader), though its own interval holds 1. Read bare, the tie said e7m0 beat bf16 (a real
    two-seed sweep: e4m3 0.995 ± 0.003 led, e7m0 1.008 ± 0.020 tied with it, bf16 out)."""
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e4m3", [0.990, 0.992, 0.994]),
               *seeded("e7m0", [0.99, 1.0, 1.02])]
    f = compute_findings(records)
    e4m3, e7m0 = f.cells["e4m3", "adamw", "all", ()], f.cells["e7m0", "adamw", "all", ()]
    assert (e4m3.vs_bf16, e7m0.vs_bf16) == ("better", "indistinguishable") and e4m3.family_wise.holds
    assert spot(f, "all").text == ("tie: e4m3 ≈ e7m0 (intervals overlap; bf16 left out: e4m3 better than bf16; "
                                   "yet e7m0 indistinguishable from bf16)")
    records[3:6] = seeded("e4m3", [0.991, 0.993, 0.995])  # p 0.026 of 2: called, not family-wise
    f = compute_findings(records)
    assert f.cells["e4m3", "adamw", "all", ()].vs_bf16 == "better"
    assert not f.cells["e4m3", "adamw", "all", ()].family_wise.holds
    assert "bf16 left out: e4m3 better than bf16, not family-wise; yet e7m0" in spot(f, "all").text


def test_overlapping_intervals_are_a_tie_and_separated_ones_are_ordered():
    f = compute_findings(study())
    e4m3 = f.cells["e4m3", "adamw", "all", ()]
    mean, hw = hand_interval([1.00, 1.02, 1.04])
    assert e4m3.ratio.mean == pytest.approx(mean) and e4m3.ratio.half_width == pytest.approx(hw, rel=1e-5)
    assert e4m3.ratio.paired and e4m3.vs_bf16 == "indistinguishable"
    assert f.cells["e5m2", "adamw", "all", ()].vs_bf16 == "worse"
    all_spot = spot(f, "all")
    assert all_spot.group == ("bf16", "e4m3") and all_spot.text.startswith("tie: bf16 ≈ e4m3")
    mlp = spot(f, "mlp")
    assert mlp.group == ("e3m4", "e2m5") and mlp.text == "tie: e3m4 ≈ e2m5 (intervals overlap; bf16 left out: e3m4 better than bf16)"
    assert f.cells["e3m4", "adamw", "mlp", ()].vs_bf16 == "better"
    assert any(n.startswith("e3m4 / mlp / adamw trained better than bf16 beyond its interval") for n in f.notes)
    assert not any(n.startswith("e4m3") for n in f.notes)  # within its interval of bf16: no anomaly
    # without e2m5, e3m4 alone leads: a sweet spot, with its interval
    alone = spot(compute_findings([r for r in study() if r.format != "e2m5"]), "mlp")
    assert alone.group == ("e3m4",) and alone.text.startswith("e3m4 at 0.910 ± 0.025")


def family_study() -> list[TrialRecord]:
    """Seven formats against bf16, three seeds: e5m2 far worse, e4m3 worse by a margin its interval
    only just resolves (the one call of the CPU study published 2026-11-24: 0.0227 ± 0.0165), five
    that match bf16."""
    nulls = {"e0m7": [0.99, 1.00, 1.01], "e1m6": [1.00, 1.01, 0.99], "e2m5": [0.98, 1.00, 1.02],
             "e3m4": [1.01, 0.99, 1.00], "e6m1": [0.995, 1.00, 1.005]}
    sd = 0.0165 / 4.302653 * math.sqrt(3)
    return [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.20, 1.21, 1.22]),
            *seeded("e4m3", [1.0227 - sd, 1.0227, 1.0227 + sd]),
            *(r for fmt, scales in nulls.items() for r in seeded(fmt, scales))]


def two_sided_p_df2(values: list[float], null: float) -> float:
    """Three values: t = (mean − null) / (s / √3), and for df 2, P(|T| > t) = 1 − t / √(t² + 2)."""
    mean = sum(values) / 3
    t = abs(mean - null) / math.sqrt(sum((v - mean) ** 2 for v in values) / 2 / 3)
    return 1 - t / math.sqrt(t * t + 2)


def test_a_marginal_call_among_many_comparisons_does_not_hold_family_wise(tmp_path):
    f = compute_findings(family_study())
    cells = {c.format: c for c in f.cells.values()}
    assert {c.family_wise.family for c in cells.values()} == {7}
    sd = 0.0165 / 4.302653 * math.sqrt(3)
    marginal, strong = cells["e4m3"], cells["e5m2"]
    p = two_sided_p_df2([1.0227 - sd, 1.0227, 1.0227 + sd], 1.0)
    assert 0.026 < p < 0.028 and marginal.family_wise.p == pytest.approx(p, rel=1e-6)
    # e5m2's p is the smallest (× 7), e4m3's the next (× 6); the other five are nowhere near 0.05
    assert marginal.vs_bf16 == "worse" and marginal.family_wise.called
    assert marginal.family_wise.adjusted == pytest.approx(6 * p, rel=1e-6) and not marginal.family_wise.holds
    assert strong.vs_bf16 == "worse" and strong.family_wise.holds
    assert strong.family_wise.adjusted == pytest.approx(7 * two_sided_p_df2([1.20, 1.21, 1.22], 1.0), rel=1e-6)
    for fmt in ("e0m7", "e1m6", "e2m5", "e3m4", "e6m1"):
        fw = cells[fmt].family_wise
        assert cells[fmt].vs_bf16 == "indistinguishable" and not fw.called and not fw.holds and fw.adjusted >= fw.p
    assert f.multiplicity() == ["× bf16: 7 comparisons with an interval, 2 called at 95 % each where chance alone "
                                "would call 0.35; 1 holds family-wise (Holm)",
                                "gradient cosine − bf16: 7 comparisons with an interval, 0 called at 95 % each "
                                "where chance alone would call 0.35; 0 hold family-wise (Holm)"]  # the same cosines
    # alone with bf16 the same cell is its own family, and its call holds
    alone = compute_findings([r for r in family_study() if r.format in ("bf16", "e4m3")]).cells["e4m3", "adamw", "all", ()]
    assert alone.family_wise.family == 1 and alone.family_wise.adjusted == pytest.approx(p, rel=1e-6)
    assert alone.family_wise.holds

    text = write_report(family_study(), tmp_path).read_text()
    assert f"| worse | not family-wise: p 0.027, Holm {6 * p:.2g} of 7 |" in text
    assert "- **Many comparisons at once:** × bf16: 7 comparisons with an interval, 2 called" in text
    assert "**Family-wise (Holm)**" in text  # defined where every number is


def test_a_sole_sweet_spot_says_which_of_its_calls_do_not_hold_family_wise():
    """bf16 alone is the sweet spot when every eligible cell is worse: each a × bf16 call, which
    may not survive the report's many comparisons. family_study's five matching formats moved to
    another precision: e5m2's call holds, e4m3's marginal one does not (× 6 over the family of 7)."""
    records = [replace(r, precision="mlp") if r.format in ("e0m7", "e1m6", "e2m5", "e3m4", "e6m1") else r
               for r in family_study()]
    f = compute_findings(records)
    assert spot(f, "all").group == ("bf16",)
    assert spot(f, "all").text == "bf16 (every format is worse; not family-wise for e4m3)"
    strong_only = compute_findings([r for r in records if r.format != "e4m3"])
    assert spot(strong_only, "all").text == "bf16 (every format is worse)"
    # a format alone: its call against bf16, the same marginal margin below bf16 among seven
    sd = 0.0165 / 4.302653 * math.sqrt(3)
    better = [r for r in records if r.format != "e4m3"] + seeded("e4m3", [0.9773 - sd, 0.9773, 0.9773 + sd])
    alone = spot(compute_findings(better), "all")
    assert alone.group == ("e4m3",) and alone.text.endswith("× bf16 (better than bf16, not family-wise)")
    clear = seeded("e4m3", [0.90, 0.91, 0.92])
    assert spot(compute_findings([*records[:3], *clear]), "all").text.endswith("× bf16")  # its call holds


def test_one_seed_says_n_1_and_is_never_called_different():
    f = compute_findings([trial("bf16"), trial("e4m3", scale=1.5), trial("e5m2", scale=1.01)])
    cell = f.cells["e4m3", "adamw", "all", ()]
    assert cell.ratio.text(3) == "1.500 (n = 1, paired, no interval)"
    assert cell.best.text() .endswith("(n = 1, no interval)")
    assert cell.vs_bf16 == "not tested (no interval)"  # one seed: no test was made, so no tie either
    assert spot(f, "all").group == ("bf16", "e5m2", "e4m3")  # nothing separates without an interval
    assert not f.verdict.passed and "n = 1, no interval" in f.verdict.reason


@pytest.mark.parametrize(("scales", "passed"), [([1.04, 1.05, 1.06], True), ([1.00, 1.05, 1.10], False),
                                                ([1.19, 1.20, 1.21], False)])
def test_verdict_uses_the_upper_end_of_the_interval(scales, passed):
    f = compute_findings([*seeded("bf16", [1, 1, 1]), *seeded("e5m2", scales)])
    v = f.verdict
    mean, hw = hand_interval(scales)
    assert v.passed is passed
    assert v.line.startswith(f"E5M2 within 10 % of BF16: {'PASS' if passed else 'INVESTIGATE'} "
                             f"(× bf16 {mean:.3f} ± {hw:.3f} (n = 3, paired)")


def test_verdict_refuses_a_cell_cut_before_the_full_budget():
    cut = seeded("e5m2", [1.0, 1.0], steps=20, summary={"stop_reason": "asha"})
    for r in cut:
        r.stop_reason = "asha"
    v = compute_findings([*seeded("bf16", [1, 1]), *cut]).verdict
    assert not v.passed and "stopped: asha" in v.reason
    running = seeded("e5m2", [1.0, 1.0], status="RUNNING", steps=20)
    v = compute_findings([*seeded("bf16", [1, 1]), *running]).verdict
    assert not v.passed and "still running (seeds {0, 1} evaluated up to step 20): no verdict on a partial" in v.reason
    # the named cell (e5m2 / all / adamw) is the verdict's whatever became of it: a healthy e5m2
    # cell elsewhere does not stand in for a broken or partial one (helper-21: a NaN'd all/adamw
    # cell read PASS on e5m2 / mlp); only a grid without the named cell is judged on another
    full = seeded("e5m2", [1.0, 1.0], prec="mlp")
    for named in (running, cut):
        v = compute_findings([*seeded("bf16", [1, 1]), *named, *full]).verdict
        assert v.cell.precision == "all" and v.passed is False
    v = compute_findings([*seeded("bf16", [1, 1]), *full]).verdict
    assert v.cell.precision == "mlp" and v.passed  # paired ratios of exactly 1: a zero-width interval


def test_collapse_step_and_site_inferred_from_metrics():
    f = compute_findings([trial("bf16"), trial("e7m0", "adamw", "all", 0.5, nan_from=37)])
    (failure,) = f.failures
    assert (failure.trial.format, failure.trial.precision, failure.stop_reason) == ("e7m0", "all", "nan")
    assert (failure.step, failure.collapsed, failure.where) == (37, True, "forward (non-finite loss)")
    assert failure.evidence == "loss non-finite at step 37; quant/overflow_rate = 0.251 > 0.01 at step 37"
    assert spot(f, "all").group == ()  # a format that collapsed is no sweet spot, whatever its loss


def test_the_failure_site_is_the_strongest_signal_of_the_whole_run_not_of_its_last_rows():
    """A run that diverged from forward overflow at its start (0.6 at step 2, 60x the threshold)
    and was stopped at step 40 with only backward underflow left (0.03) failed in the forward pass:
    the rows before the stop show the symptom, the cause came first."""
    record = trial("e4m3", summary={"stop_reason": "asha"}, steps=40)
    for row in record.history:
        row["quant/forward_overflow_rate"] = 0.6 if row["step"] == 2 else 0.0
        row["quant/backward_underflow_rate"] = 0.03 if row["step"] > 30 else 0.0
    record.stop_reason = "asha"
    (failure,) = compute_findings([trial("bf16"), record]).failures
    assert failure.where == "forward overflow"
    assert failure.evidence == "quant/forward_overflow_rate = 0.6 > 0.01 at step 2"


@pytest.mark.parametrize(
    ("record", "where", "evidence"),
    [
        (trial("e4m3", summary={"collapse_step": 12, "collapse_where": "optimizer", "stop_reason": "nan"}),
         "optimizer stall", "recorded"),
        (trial("e6m1", summary={"stop_reason": "bit_stall"}), "optimizer stall", "bit-stall"),
        # the rates by pass name the pass (helper-16: e0m7's underflow, 1.1 % over both passes, was
        # called a backward underflow; its gradients, e5m2 with delayed scaling, did not underflow)
        (trial("e0m7", summary={"stop_reason": "asha"}, **{"quant/underflow_rate": 0.0108,
                                                           "quant/forward_underflow_rate": 0.022,
                                                           "quant/backward_underflow_rate": 0.0}),
         "forward underflow", "quant/forward_underflow_rate = 0.022 > 0.01"),
        (trial("e5m2", summary={"stop_reason": "asha"}, **{"quant/overflow_rate": 0.02,
                                                           "quant/forward_overflow_rate": 0.0,
                                                           "quant/backward_overflow_rate": 0.06}),
         "backward overflow", "quant/backward_overflow_rate = 0.06 > 0.01"),
        # a run recorded before the rates by pass: its rate over both passes names no pass
        (trial("e2m5", summary={"stop_reason": "asha"}, **{"quant/underflow_rate": 0.05}),
         "underflow", "quant/underflow_rate = 0.05 > 0.01"),
        (trial("e2m5", summary={"stop_reason": "asha"},
               **{"grad/dead_frac/h.0.mlp.c_fc": 0.9, "grad/dead_frac/lm_head": 0.7}),
         "backward underflow", "grad/dead_frac = 0.8 > 0.5"),
        (trial("e1m6", summary={"stop_reason": "error"}, **{"stability/grad_has_nan": 1.0}),
         "backward (non-finite gradient)", "gradient non-finite"),
        (trial("e3m4", summary={"stop_reason": "asha"}), "—", "no signal"),
    ],
)
def test_failure_site(record, where, evidence):
    record.stop_reason = record.summary["stop_reason"]
    record.stop_detail = "asha: 23 % behind bf16 at step 20 (...)" if record.stop_reason == "asha" else None
    (failure,) = compute_findings([trial("bf16"), record]).failures
    assert failure.where == where
    assert evidence in failure.evidence
    if record.stop_detail:
        assert failure.evidence.startswith("asha: 23 % behind bf16 at step 20")


EVAL_STEPS = [1, *range(EVAL, STEPS + 1, EVAL)]  # where `trial` writes the shadow's cosine


def cosine_study() -> list[TrialRecord]:
    """Three seeds, per seed a loss scale and a gradient cosine: e7m0's gradients far off FP32's
    while its loss ties with bf16; e6m1's far off and its loss worse; e5m2's seed 2 non-finite."""
    cells = {"bf16": ([1.0, 1.0, 1.0], [0.999, 0.998, 0.999]),
             "e3m4": ([1.00, 1.01, 1.00], [0.992, 0.990, 0.988]),
             "e4m3": ([1.00, 1.01, 0.99], [0.990, 0.985, 0.990]),
             "e5m2": ([1.01, 1.00, 1.02], [0.970, 0.960, math.nan]),
             "e6m1": ([1.20, 1.21, 1.22], [0.80, 0.85, 0.75]),
             "e7m0": ([1.00, 1.02, 0.99], [0.70, 0.75, 0.65])}
    return [trial(fmt, scale=scale, seed=seed, cos=cos)
            for fmt, (scales, cosines) in cells.items()
            for seed, (scale, cos) in enumerate(zip(scales, cosines, strict=True))]


def test_gradient_cosine_is_the_mean_over_the_finite_shadow_steps_up_to_a_budget():
    from altgrad.report.records import gradient_cosine, shadow_cosines

    r = trial("e4m3", cos=0.9)
    assert gradient_cosine(r) == pytest.approx(0.9 - sum(EVAL_STEPS) / len(EVAL_STEPS) / 1e4)
    assert gradient_cosine(r, 30) == pytest.approx(0.9 - (1 + 10 + 20 + 30) / 4 / 1e4)
    assert math.isnan(gradient_cosine(trial("e4m3", cos=None)))  # no shadow
    broken = trial("e4m3", cos=0.9)
    broken.history[-1]["shadow/cos_mean"] = math.nan  # the last shadow step's gradient non-finite
    assert gradient_cosine(broken) == gradient_cosine(r, STEPS - 1) and math.isnan(shadow_cosines(broken)[-1])
    assert len(shadow_cosines(broken)) == len(EVAL_STEPS) and math.isnan(gradient_cosine(trial("e4m3", cos=math.nan)))


def test_gradients_off_fp32_are_said_even_where_the_loss_ties(tmp_path):
    """Per cell the gradient cosine over seeds and its per-seed difference from bf16's, as a family
    of its own; the formats closest to FP32 (the sweet spot's overlap rule, highest first), the
    ones further, and which of those the loss alone would call a tie with bf16."""
    f = compute_findings(cosine_study())
    fid = {g.cell.format: g for g in f.fidelity}
    assert set(fid) == {"e3m4", "e4m3", "e5m2", "e6m1", "e7m0"}
    drift = sum(EVAL_STEPS) / len(EVAL_STEPS) / 1e4
    mean, hw = hand_interval([0.70 - drift, 0.75 - drift, 0.65 - drift])
    assert fid["e7m0"].cosine.mean == pytest.approx(mean) and fid["e7m0"].cosine.half_width == pytest.approx(hw, rel=1e-5)
    mean, hw = hand_interval([0.70 - 0.999, 0.75 - 0.998, 0.65 - 0.999])
    assert fid["e7m0"].diff.mean == pytest.approx(mean) and fid["e7m0"].diff.half_width == pytest.approx(hw, rel=1e-5)
    assert fid["e7m0"].diff.paired and fid["e7m0"].verdict == "lower" and fid["e7m0"].family_wise.holds
    assert fid["e7m0"].cell.vs_bf16 == "indistinguishable" and fid["e6m1"].cell.vs_bf16 == "worse"
    assert fid["e6m1"].verdict == "lower" and fid["e6m1"].family_wise.adjusted > 0.05  # Holm: after e7m0 and e4m3
    # e5m2's non-finite seed is left out: paired with bf16 on the other two, and said
    assert fid["e5m2"].cosine.n == 2 and fid["e5m2"].diff.paired and fid["e5m2"].diff.n == 2
    assert "{2} not finite" in fid["e5m2"].diff.note and "bf16's {2} left out" in fid["e5m2"].diff.note
    assert (fid["e5m2"].nonfinite, fid["e5m2"].shadow_steps) == (len(EVAL_STEPS), 3 * len(EVAL_STEPS))
    assert {g.family_wise.family for g in f.fidelity} == {5}
    assert f.multiplicity()[1].startswith("gradient cosine − bf16: 5 comparisons with an interval")
    summary = f.fidelity_summary()
    assert len(summary) == 1
    e3m4 = fid["e3m4"].cosine.text(3)
    def yet(fmt: str) -> str:  # closest, yet its own cosine − bf16 below 0
        return f"; yet {fmt} lower than bf16" + ("" if fid[fmt].family_wise.holds else ", not family-wise")

    assert fid["e5m2"].diff.lo < 0 < fid["e5m2"].diff.hi  # the third of the tie is not apart from bf16
    assert summary[0] == (f"all, adamw: closest to FP32: e3m4 {e3m4} ≈ e4m3 ≈ e5m2 (intervals overlap"
                          f"{yet('e3m4')}{yet('e4m3')}); further: "
                          f"e6m1 {fid['e6m1'].cosine.text(3)} (− bf16 not family-wise), "
                          f"e7m0 {fid['e7m0'].cosine.text(3)}; loss not separated from bf16's for e7m0")

    text = write_report(cosine_study(), tmp_path).read_text()
    assert f"- **Gradients against the FP32 shadow**, {summary[0]}." in text
    section = text.split("## Gradients against the FP32 shadow", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith("| e7m0 |"))
    assert (f"| 0 of {3 * len(EVAL_STEPS)} | {fid['e7m0'].cosine.text()} | {fid['e7m0'].baseline.text()} | "
            f"{fid['e7m0'].diff.text()} | lower | {fid['e7m0'].family_wise.text} | indistinguishable | completed |") in row
    assert "- gradient cosine, e5m2 / all, adamw: " in text and "**Gradient cosine** of a trial" in text
    # without the shadow there is nothing to say, and the report says nothing
    quiet = [replace(r, history=[{k: v for k, v in row.items() if k != "shadow/cos_mean"} for row in r.history])
             for r in cosine_study()]
    assert compute_findings(quiet).fidelity == [] and len(compute_findings(quiet).multiplicity()) == 1
    assert "## Gradients against the FP32 shadow" not in write_report(quiet, tmp_path / "quiet").read_text()


def test_gradient_cosine_ranks_healthy_full_budgets_and_pairs_each_seed_over_its_own_steps(tmp_path):
    """A broken cell (e5m2: seed 0 stopped for NaN at step 30) and a partial one (e6m1: seed 2
    still running at 30, left out) are in the table but not ranked; a seed that broke early is
    compared with bf16's same seed over the same steps; a non-finite shadow step (e7m0 seed 1, step 20) is
    left out and counted; a cell without a finite cosine (e0m7) is kept, with nothing to rank."""
    records = [*(trial("bf16", seed=s, cos=0.999) for s in range(3)),
               *(trial("e4m3", scale=x, seed=s, cos=c) for s, (x, c) in enumerate([(1.0, 0.99), (1.01, 0.985), (0.99, 0.99)])),
               replace(trial("e5m2", seed=0, cos=0.5, steps=30), stop_reason="nan"),
               *(trial("e5m2", seed=s, cos=0.5) for s in (1, 2)),
               *(trial("e6m1", seed=s, cos=0.6) for s in (0, 1)), trial("e6m1", seed=2, cos=0.6, steps=30, status="RUNNING"),
               *(trial("e7m0", scale=x, seed=s, cos=0.7) for s, x in enumerate([1.0, 1.01, 0.99])),
               *(trial("e0m7", seed=s, cos=math.nan) for s in range(3))]
    next(r for r in records if (r.format, r.seed) == ("e7m0", 1)).history[19]["shadow/cos_mean"] = math.nan
    f = compute_findings(records)
    fid = {g.cell.format: g for g in f.fidelity}
    # e5m2's seed 0 against bf16's seed 0 over steps 1-30 on both sides: the drift cancels exactly
    assert fid["e5m2"].diff.paired and fid["e5m2"].diff.mean == pytest.approx(0.5 - 0.999, abs=1e-12)
    e7m0 = [0.7 - sum(EVAL_STEPS) / len(EVAL_STEPS) / 1e4, 0.7 - sum(set(EVAL_STEPS) - {20}) / (len(EVAL_STEPS) - 1) / 1e4]
    assert fid["e7m0"].cosine.mean == pytest.approx((2 * e7m0[0] + e7m0[1]) / 3)
    assert (fid["e7m0"].nonfinite, fid["e7m0"].shadow_steps) == (1, 3 * len(EVAL_STEPS))
    assert fid["e0m7"].cosine.n == 0 and "{0, 1, 2} not finite" in fid["e0m7"].diff.note
    assert fid["e7m0"].family_wise.holds
    assert fid["e4m3"].diff.hi < 0 and fid["e4m3"].family_wise.holds
    assert f.fidelity_summary() == [f"all, adamw: closest to FP32: e4m3 {fid['e4m3'].cosine.text(3)} (yet e4m3 "
                                    "lower than bf16); further: "
                                    f"e7m0 {fid['e7m0'].cosine.text(3)}; loss not separated from bf16's for e7m0"]
    text = write_report(records, tmp_path).read_text()
    assert "| e5m2 | adamw | all | — | 60 | 0 of 18 |" in text and "| nan |" in text
    # its running seed: left out, as from its loss, and bf16's column is over the seeds paired with it
    assert fid["e6m1"].cosine.n == 2 and fid["e6m1"].baseline.n == 2 and fid["e6m1"].diff.n == 2
    assert "| e0m7 | adamw | all | — | 60 | 21 of 21 | no finite value (n = 0) |" in text
    # the group's label names its extra-axis values (bf16 carries none of the quant axes)
    stochastic = [r if r.format == "bf16" else replace(r, axes={"quant.rounding": "stochastic"}) for r in records]
    assert compute_findings(stochastic).fidelity_summary()[0].startswith("all, adamw, rounding=stochastic: closest to FP32: e4m3 ")
    # a seed that shifted a layer's format before an evaluation takes its cell out of the ranking too
    next(r for r in records if (r.format, r.seed) == ("e4m3", 2)).events = [shift(30, "lm_head", "e4m3", "e3m4")]
    assert compute_findings(records).fidelity_summary()[0].startswith("all, adamw: closest to FP32: e7m0 ")


def test_manifold_delta_per_format_with_its_interval():
    records = [*seeded("bf16", [1, 1, 1]), *seeded("bf16", [1, 1, 1], "manifold"),
               *seeded("e5m2", [1.05, 1.06, 1.07]), *seeded("e5m2", [1.01, 1.02, 1.04], "manifold"),
               *seeded("e4m3", [1.03, 1.04, 1.05]), *seeded("e4m3", [1.03, 1.05, 1.04], "manifold")]
    f = compute_findings(records)
    deltas = {d.a.format: d for d in f.deltas}
    assert set(deltas) == {"e4m3", "e5m2"}
    mean, hw = hand_interval([(b - a) * BF16_BEST for a, b in zip([1.05, 1.06, 1.07], [1.01, 1.02, 1.04], strict=True)])
    assert deltas["e5m2"].diff.mean == pytest.approx(mean) and deltas["e5m2"].diff.half_width == pytest.approx(hw, rel=1e-5)
    assert deltas["e5m2"].verdict == "lower (better)"
    assert deltas["e4m3"].verdict == "indistinguishable"
    assert {d.family_wise.family for d in deltas.values()} == {2}  # the manifold table is a family
    assert compute_findings([r for r in records if r.optimizer == "adamw"]).deltas == []


def test_extra_axes_are_cells_of_their_own_and_compared():
    """rounding=stochastic vs nearest per format, each against the one bf16 (quant.* axes do not
    apply to bf16, so its trials carry no rounding)."""
    records = seeded("bf16", [1, 1, 1])
    for rounding, scales in (("nearest", [1.10, 1.11, 1.12]), ("stochastic", [1.00, 1.01, 1.02])):
        for r in seeded("e4m3", scales):
            r.axes = {"quant.rounding": rounding}
            records.append(r)
    f = compute_findings(records)
    assert f.axes == ((("quant.rounding", "nearest"),), (("quant.rounding", "stochastic"),))
    stochastic = f.cells["e4m3", "adamw", "all", (("quant.rounding", "stochastic"),)]
    assert stochastic.ratio.mean == pytest.approx(1.01) and stochastic.ratio.paired
    (effect,) = f.axis_effects
    assert effect.what == "rounding: stochastic − nearest" and effect.verdict == "lower (better)"
    assert effect.family_wise.family == 1 and effect.family_wise.holds  # a family of one: p as it is
    assert effect.family_wise.adjusted == effect.family_wise.p < 0.05
    assert effect.diff.mean == pytest.approx(-0.1 * BF16_BEST)
    assert {(s.axes, s.group) for s in f.sweet_spots} == {
        ((("quant.rounding", "nearest"),), ("bf16",)), ((("quant.rounding", "stochastic"),), ("bf16", "e4m3"))}


def test_a_difference_says_which_side_shifted_its_format(tmp_path):
    """manifold − adamw over a cell whose manifold seed 1 shifted a layer: the row says so (the
    cell is out of the sweet spot, but a difference is still read)."""
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e4m3", [1.02, 1.03, 1.04]),
               *seeded("e4m3", [1.00, 1.01, 1.02], opt="manifold")]
    records[7].events = [shift(20, "lm_head", "e4m3", "e3m4")]
    text = write_report(records, tmp_path).read_text()
    table = text.split("## Manifold vs standard optimizer", 1)[1].split("\n## ", 1)[0]
    (row,) = [line for line in table.splitlines() if line.startswith("| manifold − adamw")]
    assert row.endswith("| second: format shift in seed {1} |")


def test_an_axis_effect_names_the_other_axes_it_holds_fixed(tmp_path):
    """With two extra axes, each effect row of the axes table is taken at one value of the other
    axis, and says which; the compared axis is the row's `difference`, not repeated beside it."""
    records = []
    for lr in (0.001, 0.002):
        for r in seeded("bf16", [1, 1, 1]):  # bf16 runs per lr too (optim.* applies to it)
            r.axes = {"optim.lr": lr}
            records.append(r)
        for rounding, scales in (("nearest", [1.10, 1.11, 1.12]), ("stochastic", [1.00, 1.01, 1.02])):
            for r in seeded("e4m3", scales):
                r.axes = {"quant.rounding": rounding, "optim.lr": lr}
                records.append(r)
    text = write_report(records, tmp_path).read_text()
    table = text.split("## Extra grid axes", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| rounding:")]
    assert len(rows) == 2
    assert {row.split(" | ")[4] for row in rows} == {"lr=0.001", "lr=0.002"}
    assert not any("rounding=" in row for row in rows)


def test_mixed_seed_sets_still_render_and_say_why(tmp_path):
    records = [*seeded("bf16", [1.0, 1.0]), *seeded("e4m3", [1.0, 1.1, 1.05])]  # bf16 lacks seed 2
    text = write_report(records, tmp_path).read_text()
    cell = compute_findings(records).cells["e4m3", "adamw", "all", ()]
    assert cell.ratio.paired and cell.ratio.n == 2
    assert "paired on the seeds both have, {0, 1}: e4m3's {2} left out" in text.split(
        "## Comparisons not paired on every seed")[1]


def test_equivalent_formats_are_one_measurement(tmp_path):
    """An alias record (e1m6, same_as e0m7's trial) is listed under both names, counted once."""
    e0m7 = seeded("e0m7", [1.1, 1.12])
    e0m7[0].events = [{"step": 3, "kind": "underflow_warn", "message": "underflow 2 % > 1 %"}]
    aliases = [replace(r, key=f"e1m6-{r.seed}", format="e1m6", same_as=r.key or r.trial_id) for r in e0m7]
    for r in e0m7:
        r.key = r.trial_id
    records = [*seeded("bf16", [1, 1]), *e0m7, *aliases]
    f = compute_findings(records)
    assert f.aliases == {"e1m6": "e0m7"} and f.formats == ("e0m7", "e1m6")
    assert list(f.cells) == [("e0m7", "adamw", "all", ())] and f.cells["e0m7", "adamw", "all", ()].name == "e0m7 ≡ e1m6"
    assert f.measured_name("e0m7") == "e0m7 ≡ e1m6" and f.measured_name("bf16") == "bf16"
    text = write_report(records, tmp_path).read_text()
    assert "**One measurement, two names:** e1m6 was not run" in text
    assert "| e0m7 ≡ e1m6 | adamw | all | — | underflow | {0} of 2 | 3 | 1 |" in text  # the warnings, as the cells
    heat = plot_heatmap(f, "adamw", (), tmp_path / "heat.png")
    texts = heat.texts["Best val loss / bf16 — optimizer adamw"]
    assert texts[1].endswith("≡ e0m7") and texts[0].split("\n")[:2] == texts[1].split("\n")[:2]


def test_a_bf16_seed_cut_short_is_not_the_baseline_of_a_longer_cell(tmp_path):
    """bf16 seed 1 stopped at step 30 of 60: its best loss is a 30-step budget's, so e4m3's seed 1
    (60 steps) is not divided by it. The comparison is unpaired against bf16's seed 0, and says why."""
    cut = replace(trial("bf16", seed=1, scale=1.05, steps=30), stop_reason="asha")
    records = [trial("bf16", seed=0), cut, *seeded("e4m3", [1.02, 1.03])]
    ratio = compute_findings(records).cells["e4m3", "adamw", "all", ()].ratio
    assert not ratio.paired and (ratio.n, ratio.n_other) == (2, 1)
    assert ratio.mean == pytest.approx((1.02 + 1.03) / 2)  # against seed 0's full-budget bf16 alone
    assert "bf16 seed {1} evaluated only up to step 30 of the cell's 60 (asha), left out" in ratio.note
    assert ratio.note in write_report(records, tmp_path).read_text()


def test_a_format_given_a_longer_budget_than_bf16_is_compared_with_nothing_and_says_so(tmp_path):
    """e5m2 ran 60 steps (`grid.format_overrides`), every bf16 seed 40: no bf16 seed is a baseline
    at e5m2's budget. The verdict, the cell, its gradient cosine and the heatmap say that, not that
    e5m2 had no finite loss (it had), and the cell is in no Holm family."""
    records = [*(trial("bf16", seed=s, steps=40) for s in range(3)), *seeded("e5m2", [0.9, 0.91, 0.92]),
               *seeded("e4m3", [1.01, 1.02, 1.03], steps=40)]
    f = compute_findings(records)
    cell = f.cells["e5m2", "adamw", "all", ()]
    why = "no bf16 seed evaluated up to its step 60, bf16's last evaluation being at step 40"
    assert cell.no_baseline == why and cell.steps == 60 and cell.best.n == 3
    assert cell.vs_bf16 == f"not compared ({why})" and cell.family_wise is None
    assert not f.verdict.passed and f.verdict.reason.endswith(why) and "no finite" not in f.verdict.reason
    fid = next(g for g in f.fidelity if g.cell is cell)
    assert fid.verdict == f"not compared ({why})" and fid.family_wise is None
    e4m3 = f.cells["e4m3", "adamw", "all", ()]  # bf16's budget: compared, alone in its family
    assert e4m3.no_baseline == "" and e4m3.family_wise.family == 1
    text = write_report(records, tmp_path).read_text()
    assert f"| 60 | — | not compared ({why}) |" in text and "no finite value" not in text
    assert "bf16 seeds {0, 1, 2} evaluated only up to step 40 of the cell's 60 (completed), left out\n" in text


def test_a_collapsed_trial_s_non_finite_shadow_steps_after_its_collapse_are_counted():
    """e7m0 collapsed at step 25 and went on logging to 60 (NaN steps skipped), its shadow cosine
    non-finite from then on: those shadow steps are counted as non-finite (up to the last step it
    logged, as the definition says), not cut at the collapse, which hid exactly them."""
    broken = []
    for seed in range(3):
        t = trial("e7m0", seed=seed, nan_from=25)
        for row in t.history:
            if row["step"] >= 25 and "shadow/cos_mean" in row:
                row["shadow/cos_mean"] = math.nan
        broken.append(t)
    f = compute_findings([*seeded("bf16", [1.0, 1.0, 1.0]), *broken])
    fid = next(g for g in f.fidelity if g.cell.format == "e7m0")
    after = [s for s in EVAL_STEPS if s >= 25]
    assert fid.cell.steps == STEPS and (fid.nonfinite, fid.shadow_steps) == (3 * len(after), 3 * len(EVAL_STEPS))
    assert fid.cosine.mean == pytest.approx(0.99 - sum(s for s in EVAL_STEPS if s < 25) / len(EVAL_STEPS[:3]) / 1e4)
    # bf16's cosine (the same curve) over the same steps, up to the collapse: no difference
    assert fid.diff.mean == pytest.approx(0.0, abs=1e-12) and fid.verdict == "indistinguishable"


@pytest.mark.parametrize("status, stop, why", [("RUNNING", None, "still running")])
def test_a_cell_seed_cut_short_is_left_out_of_the_cell(tmp_path, status, stop, why):
    """e4m3 seed 2, still running, evaluated only up to step 30 of 60: its best loss is a 30-step
    budget's, which against bf16's 60-step one read ~20 % worse (helper-16). The cell's value and
    × bf16 are its other seeds', paired with bf16's, and the report says why."""
    short = replace(trial("e4m3", seed=2, scale=1.01, steps=30, status=status), stop_reason=stop)
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e4m3", [1.02, 1.03]), short]
    cell = compute_findings(records).cells["e4m3", "adamw", "all", ()]
    assert cell.short == (2,) and cell.steps == STEPS
    assert (cell.best.n, cell.ratio.n, cell.ratio.paired) == (2, 2, True)
    assert cell.best.mean == pytest.approx(BF16_BEST * (1.02 + 1.03) / 2)
    assert cell.ratio.mean == pytest.approx((1.02 + 1.03) / 2)
    note = f"e4m3 seed {{2}} evaluated only up to step 30 of the cell's {STEPS} ({why}), left out"
    assert note in cell.ratio.note and "bf16's {2} left out" in cell.ratio.note
    text = write_report(records, tmp_path).read_text()
    assert note in text and "| e4m3 | adamw | all | — | 0, 1 (short, left out: 2) |" in text
    # nor does its curve end where the short seed stopped: the band spans the seeds the numbers use
    x, _ = plot_loss(compute_findings(records), "adamw", (), tmp_path / "loss.png").lines["precision: all", "e4m3"]
    assert x[-1] == STEPS


def test_a_baseline_computed_in_fp32_is_called_so():
    """On the CPU there is no bf16 autocast: "bf16" is the model in fp32, and the report says so
    (SPEC §2 defines the baseline as bf16 compute); on CUDA it says nothing; a mix is called out."""
    def notes(autocast: list[bool | None]) -> list[str]:
        records = [*seeded("bf16", [1.0] * len(autocast)), *seeded("e4m3", [1.01] * len(autocast))]
        for r, a in zip(records, autocast, strict=False):
            r.autocast = a
        return [n for n in compute_findings(records).notes if "fp32" in n]

    (fp32,) = notes([False, False])
    assert fp32.startswith("**bf16 here is the model in fp32**") and "× bf16 compares a format with fp32" in fp32
    assert notes([True, True]) == [] and notes([None, None]) == []
    (mixed,) = notes([True, False])
    assert "do not share one baseline" in mixed
    # the headline says it too, not only the notes
    records = [*seeded("bf16", [1.0, 1.0]), *seeded("e5m2", [1.01, 1.02])]
    for fp32 in (True, False):
        for r in records:
            r.autocast = not fp32
        line = compute_findings(records).verdict.line
        assert ("× bf16 (run in fp32) 1.015" in line) == fp32 and ("× bf16 1.015" in line) == (not fp32)


@pytest.mark.parametrize("stop", ["nan", "asha"])
def test_a_seed_that_was_stopped_stays_in_its_cell_which_is_not_compared(tmp_path, stop):
    """A seed stopped early (NaN, or ASHA: 25 % behind bf16) at step 30 of 60 is the cell's result,
    not a budget still to come: it stays in the cell's numbers, the cell is broken, and since its
    seeds stopped at different steps its × bf16 is not read, nor counted among the Holm family
    (leaving it out, as 829b79a did for ASHA, read the survivors as "indistinguishable")."""
    broke = replace(trial("e5m2", seed=2, scale=1.25, steps=30), stop_reason=stop)
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.0, 1.001]), broke,
               *seeded("e4m3", [1.01, 1.02, 1.03])]
    f = compute_findings(records)
    cell = f.cells["e5m2", "adamw", "all", ()]
    assert cell.short == () and cell.best.n == 3 and cell.ratio.n == 3 and cell.broke and cell.stops == (stop,)
    assert cell.vs_bf16.startswith(f"not compared (broke before the final evaluation: {stop}")
    assert cell.broke_early and cell.family_wise is None
    assert cell.vs_bf16.endswith("; seeds stopped at different steps)")
    assert f.cells["e4m3", "adamw", "all", ()].family_wise.family == 1
    text = write_report(records, tmp_path).read_text()
    assert f"| {cell.vs_bf16} | — |" in text


def diverged(seed: int, factor: float, stop_at: int = 30) -> TrialRecord:
    """An e4m3 seed that ASHA stopped at `stop_at`: from its second evaluation on its val loss is
    `factor` × bf16's."""
    t = trial("e4m3", seed=seed, steps=stop_at)
    for row in t.history:
        if row["val/step"] > 1:
            row["val/loss"] = factor * curve(row["val/step"], 1.0)
    return replace(t, stop_reason="asha", summary={**t.summary, "best_val_loss": curve(1, 1.0),
                                                       "stop_reason": "asha"})


def test_a_cell_whose_seeds_broke_together_says_how_far_behind_they_stopped(tmp_path):
    """Seeds ASHA stopped at the same step after diverging: their best val loss may predate the
    divergence (a real sweep's: the first evaluation's, 1.07x bf16's, where the loss at the stop was
    3.9x), so read as a ratio it can pass for a small effect ("worse, a lead for more seeds"). The
    cell is not compared: it says the val loss at each seed's last evaluation against bf16's there,
    and stays out of the Holm family."""
    factors = [2.0, 2.2, 2.6]
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *(diverged(s, k) for s, k in enumerate(factors)),
               *seeded("e5m2", [1.01, 1.02, 1.03])]
    f = compute_findings(records)
    cell = f.cells["e4m3", "adamw", "all", ()]
    assert cell.broke and not cell.mixed_budgets and cell.steps == 30
    mean, hw = hand_interval(factors)
    assert cell.at_stop.mean == pytest.approx(mean) and cell.at_stop.half_width == pytest.approx(hw)
    assert cell.vs_bf16 == (f"not compared (broke before the final evaluation: asha; val loss at the last "
                            f"evaluation of seeds {{0, 1, 2}} {mean:.2f} ± {hw:.2f} (n = 3, paired) × bf16's there)")
    assert cell.family_wise is None and f.cells["e5m2", "adamw", "all", ()].family_wise.family == 1
    assert f"| {cell.vs_bf16} | — | asha |" in write_report(records, tmp_path).read_text()


def test_missing_optimizer_baseline_is_borrowed_and_noted():
    records = [trial("bf16"), trial("e4m3", "manifold", scale=1.2)]
    f = compute_findings(records)
    assert f.cells["e4m3", "manifold", "all", ()].ratio.mean == pytest.approx(1.2)
    assert any("`manifold` has no bf16 trial" in n for n in f.notes)


@pytest.mark.parametrize("manifold_scales, noted", [([1.0, 1.02], True), ([1.0, 1.0200001], False), ([1.0], False)])
def test_bf16_measured_twice_is_said_to_be_one_measurement(tmp_path, manifold_scales, noted):
    """bf16 under `manifold` takes AdamW's steps (no quantized weight): when its losses equal
    adamw's seed for seed, the report says it is one measurement twice; a loss off in its last
    digits, or a seed missing, is two measurements and says nothing."""
    records = [*seeded("bf16", [1.0, 1.02]), *seeded("bf16", manifold_scales, "manifold"),
               *seeded("e4m3", [1.1, 1.12]), *seeded("e4m3", [1.05, 1.06], "manifold")]
    f = compute_findings(records)
    said = [n for n in f.notes if "one measurement twice" in n]
    assert len(said) == int(noted)
    if noted:
        assert said[0].startswith("`manifold`'s bf16 trials equal `adamw`'s") and "takes `adamw`'s steps" in said[0]
        assert said[0] in write_report(records, tmp_path).read_text()


def test_loss_plot_draws_the_seed_mean_and_band(tmp_path):
    records = study()
    f = compute_findings(records)
    plot = plot_loss(f, "adamw", (), tmp_path / "loss.png")
    assert {panel for panel, _ in plot.lines} == {"precision: all", "precision: mlp", "precision: all, steps 30-60",
                                                  "precision: mlp, steps 30-60"}
    e2m5 = [r for r in records if r.format == "e2m5"]
    steps = e2m5[0].val_series()[0]
    per_seed = np.array([r.val_series()[1] for r in e2m5])
    x, y = plot.lines["precision: mlp", "e2m5"]
    np.testing.assert_array_equal(x, steps)
    np.testing.assert_allclose(y, per_seed.mean(0))
    bx, lo, hi = plot.bands["precision: mlp", "e2m5 seeds"]
    np.testing.assert_array_equal(bx, steps)
    np.testing.assert_allclose(lo, per_seed.min(0))
    np.testing.assert_allclose(hi, per_seed.max(0))
    assert ("precision: all", "bf16") in plot.lines  # bf16 dashed in every panel
    # below, the second half on the scale of its own losses: e6m1 1.30x bf16 and e3m4 0.90x stay in view
    (x0, x1), (y0, y1) = plot.limits["precision: mlp, steps 30-60"]
    late = [v for r in records if r.precision == "mlp" or r.format == "bf16"
            for s, v in zip(*r.val_series(), strict=True) if s >= 30]
    assert (x0, x1) == (30, 60) and y0 < min(late) and max(late) < y1
    assert y1 - y0 < 0.3 * (plot.limits["precision: mlp"][1][1] - plot.limits["precision: mlp"][1][0])
    assert plot.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stability_and_heatmap_data_match_input(tmp_path):
    records = study()
    f = compute_findings(records)
    plot = plot_stability(f, "adamw", (), tmp_path / "stability.png")
    r = next(r for r in records if (r.format, r.precision, r.seed) == ("e6m1", "mlp", 1))
    # these trials logged no rate by pass (as runs before them): the overflow row draws both passes'
    for panel, label, metric in (("quant/bit_stall_rate", "e6m1 s1", "quant/bit_stall_rate"),
                                 ("quant/overflow_rate by pass", "e6m1 s1 both passes", "quant/overflow_rate"),
                                 ("shadow/cos_mean", "e6m1 s1", "shadow/cos_mean")):
        x, y = plot.lines[f"mlp: {panel}", label]
        np.testing.assert_array_equal(x, r.series(metric)[0])
        np.testing.assert_array_equal(y, r.series(metric)[1])
    assert not [label for panel, label in plot.lines if panel == "mlp: quant/underflow_rate by pass"]
    assert not any(label.startswith("bf16") for _, label in plot.lines)

    heat = plot_heatmap(f, "adamw", (), tmp_path / "heat.png")
    panel = "Best val loss / bf16 — optimizer adamw"
    assert f.formats == ("e2m5", "e3m4", "e4m3", "e5m2", "e6m1")
    means = {("e2m5", "mlp"): [0.91, 0.93, 0.95], ("e3m4", "mlp"): [0.90, 0.91, 0.92],
             ("e4m3", "all"): [1.00, 1.02, 1.04], ("e5m2", "all"): [1.20, 1.21, 1.22],
             ("e6m1", "mlp"): [1.30, 1.31, 1.32]}
    expected = [[hand_interval(means[fmt, p])[0] if (fmt, p) in means else np.nan for p in ("all", "mlp")]
                for fmt in f.formats]
    np.testing.assert_allclose(heat.images[panel], expected)
    annotated = [t for t in heat.texts[panel] if "±" in t]
    assert f"{hand_interval(means['e4m3', 'all'])[0]:.3f}\n± {hand_interval(means['e4m3', 'all'])[1]:.3f}" in annotated


def drawn_extent(monkeypatch: pytest.MonkeyPatch, draw) -> tuple[np.ndarray, np.ndarray]:
    """(figure size, extent of everything drawn) in inches, [x0, y0, x1, y1], of the figure `draw()`
    saves: read off the figure matplotlib is asked to save."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (saved.append(fig), save(fig, *a, **kw))[1])
    draw()
    (fig,) = saved
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.array([0, 0, *fig.get_size_inches()]), np.array(fig.get_tightbbox(canvas.get_renderer()).extents)


@pytest.mark.parametrize("n_formats", [1, 2, 3, 8])
def test_every_figure_draws_inside_its_canvas(tmp_path, monkeypatch, n_formats):
    """Nothing a figure draws is cut off at its edge: the heatmap's colour-bar label, as long as a
    one-format heatmap is tall, was ("lower is b..."). Any number of formats, and the other figures."""
    formats = ["e4m3", "e5m2", "e3m4", "e2m5", "e6m1", "e7m0", "e1m6", "e0m7"][:n_formats]
    records = [*seeded("bf16", [1.0, 1.0]), *(r for fmt in formats for r in seeded(fmt, [1.01, 1.03]))]
    f = compute_findings(records)
    drawers = [lambda: plot_heatmap(f, "adamw", (), tmp_path / "heat.png"),
               lambda: plot_loss(f, "adamw", (), tmp_path / "loss.png"),
               lambda: plot_stability(f, "adamw", (), tmp_path / "stability.png")]
    for draw in drawers:
        canvas, drawn = drawn_extent(monkeypatch, draw)
        monkeypatch.undo()
        assert (drawn[:2] >= canvas[:2] - 0.01).all() and (drawn[2:] <= canvas[2:] + 0.01).all(), (canvas, drawn)


def test_the_stability_legend_covers_no_panel(tmp_path, monkeypatch):
    """Fifteen trials gave a 15-entry legend over the top panel's title and data (helper-16): the
    legend now names each format once, beside the panels, and each row says what it plots."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [*seeded("bf16", [1.0] * 3), *(r for fmt in ("e2m5", "e3m4", "e4m3", "e5m2", "e7m0")
                                             for r in seeded(fmt, [1.01, 1.02, 1.03]))]
    saved: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (saved.append(fig), save(fig, *a, **kw))[1])
    plot_stability(compute_findings(records), "adamw", (), tmp_path / "stability.png")
    (fig,) = saved
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    (legend,) = fig.legends
    # and each line style once: these runs logged no rate by pass, only the rate over both
    assert [t.get_text() for t in legend.get_texts()] == ["e2m5", "e3m4", "e4m3", "e5m2", "e7m0", "both passes"]
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_tightbbox(renderer)), ax.get_title()
    assert [ax.get_ylabel() for ax in fig.axes[::len(fig.axes) // 6]] == [
        "bit-stall rate", "overflow rate", "underflow rate", "dead-gradient fraction", "zero-update fraction",
        "cosine to FP32 gradients"]


def test_partial_experiment_lists_what_is_missing():
    records = [
        trial("bf16"),
        trial("e4m3", prec="all"),
        trial("e5m2", prec="all", status="RUNNING", steps=20),
        trial("e4m3", prec="mlp", status="PENDING", steps=0),
    ]
    missing = compute_findings(records, missing=["e2m5/adamw/all: never started", "e4m3_adamw_mlp_0"]).missing
    assert missing == [
        "e2m5/adamw/all: never started",
        "e4m3_adamw_mlp_0",  # the caller named it: not repeated as "not started"
        "e5m2_adamw_all_0 (e5m2 / adamw / all): still running at step 20, numbers provisional",
    ]
    assert "e4m3_adamw_mlp_0 (e4m3 / adamw / mlp): not started" in compute_findings(records).missing


def test_a_report_on_a_running_sweep_claims_nothing_it_has_not_seen(tmp_path):
    """A trial that has reported no step yet and one not started: no failure is "every trial
    completed", no step is None, and a cell without an evaluation is not compared with bf16 (whose
    finished seed is not "not finite")."""
    records = [trial("bf16"), trial("e5m2", status="RUNNING", steps=0, summary={"steps": None}),
               trial("e7m0", status="PENDING", steps=0)]
    f = compute_findings(records)
    assert "e5m2_adamw_all_0 (e5m2 / adamw / all): still running, no step reported yet" in f.missing
    e5m2 = f.cells["e5m2", "adamw", "all", ()]
    assert e5m2.vs_bf16 == "not compared (no finite value)" and e5m2.ratio.note == "no evaluation yet"
    text = write_report(records, tmp_path).read_text()
    assert "No trial has failed so far; 2 not finished" in text and "Every trial completed" not in text
    assert "not finite" not in text and "step None" not in text and "not tested (no interval)" not in text
    # a cell without an evaluation reads as such, not as a loss that went non-finite
    assert "| e5m2 | adamw | all | — | 0 | not evaluated yet | 0 | — | — |" in text
    heat = plot_heatmap(f, "adamw", (), tmp_path / "heat.png")  # the heatmap says so too
    assert "not evaluated yet" in heat.texts["Best val loss / bf16 — optimizer adamw"]
    assert "no finite value" not in text and "e5m2 / all, adamw: no evaluation yet" not in text
    # bf16 itself still running: its number is provisional, and said
    running = [trial("bf16", status="RUNNING", steps=20), trial("e5m2")]
    assert "bf16 best val loss: adamw " in (text := write_report(running, tmp_path / "r").read_text())
    assert text.split("bf16 best val loss: adamw ", 1)[1].split(".\n", 1)[0].endswith(
        "(provisional: still running)")


def test_only_baseline_trials(tmp_path):
    text = write_report([trial("bf16")], tmp_path).read_text()
    assert "INVESTIGATE" in text and "no e5m2 trial" in text
    assert (tmp_path / "loss_adamw.png").stat().st_size > 0


def run_dir(root, r: TrialRecord):
    return root / TRIALS_DIR / r.trial_id / RUN_DIR


def write_state(root, records: list[TrialRecord]):
    """The sweep's state files that `load_experiment` reads (see altgrad/experiment.py): one grid
    point per record, keyed by its trial id, whose run directory is `run_dir(root, record)`; its
    sweep running in this process (a RUNNING trial of a sweep whose driver is gone reads PAUSED)."""
    points = [{"key": r.trial_id, "format": r.format, "optimizer": r.optimizer,
               "precision": r.precision, "seed": r.seed, "params": {}} for r in records]
    trials = {r.trial_id: {**point, "dir": r.trial_id, "status": r.status, "failures": 0, "error": None}
              for r, point in zip(records, points, strict=True) if r.status != "PENDING"}
    (root / STATE_DIR).mkdir(parents=True)
    driver = {"pid": os.getpid(), "host": socket.gethostname()}
    (root / STATE_DIR / SWEEP_FILE).write_text(json.dumps({"points": points, "status": "running", "driver": driver}))
    (root / STATE_DIR / TRIALS_FILE).write_text(json.dumps(trials))
    return root


def write_experiment(root, records: list[TrialRecord]):
    """An experiment directory holding the synthetic records' run files."""
    for r in records:
        if r.status != "PENDING":
            run = run_dir(root, r)
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in r.history))
            status = "finished" if r.status == "TERMINATED" else "running"
            (run / "summary.json").write_text(json.dumps({**r.summary, "status": status}))
            (run / "config.yaml").write_text(dump_config(RunConfig(stability=r.stability)))
            (run / "events.jsonl").write_text("".join(json.dumps(event) + "\n" for event in r.events))
    return write_state(root, records)


def main(argv: list[str]) -> int:
    """`python -m altgrad report ...` without importing the other sub-commands (torch)."""
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def shift(step: int, layer: str, old: str, new: str) -> dict:
    """A `format_shift` event as the trainer writes it (`altgrad.train.format_shift`)."""
    return {"step": step, "kind": "format_shift", "message": f"{layer}: {old} -> {new} (nan)", "layer": layer,
            "from": old, "to": new, "reason": "nan"}


def test_a_cell_that_shifted_formats_is_said_and_out_of_the_sweet_spot_and_verdict(tmp_path, capsys):
    """An emergency mantissa shift moves a layer to another format mid-run: e3m4 seed 1, whose cell
    would lead mlp's sweet spot, ended with a layer in e2m5, and e5m2 seed 0 with one in e4m3. The
    report said nothing of either, crediting e3m4 and e5m2 with what partly other formats trained."""
    records = study()
    e3m4 = next(r for r in records if (r.format, r.seed) == ("e3m4", 1))
    e3m4.events = [{"step": 5, "kind": "bit_stall_warn", "message": "..."}, shift(12, "h.0.mlp.c_fc", "e3m4", "e2m5")]
    e5m2 = next(r for r in records if (r.format, r.seed) == ("e5m2", 0))
    e5m2.events = [shift(30, "lm_head", "e5m2", "e4m3"), shift(41, "h.0.attn.c_attn", "e5m2", "e4m3"),
                   {**shift(50, "lm_head", "e4m3", "e3m4"), "reason": "bit_stall"}]  # the head shifts twice
    exp = write_experiment(tmp_path / "exp", records)
    assert main(["report", str(exp), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert ("- **Emergency format shifts**, e3m4 / adamw / mlp seed 1: 1 shift from step 12 (nan); layers ended "
            "in e2m5: h.0.mlp.c_fc. Its cell's numbers are not e3m4's alone") in text
    assert ("e5m2 / adamw / all seed 0: 3 shifts from step 30 (bit_stall, nan); layers ended in e3m4: lm_head; "
            "e4m3: h.0.attn.c_attn.") in text
    assert "INVESTIGATE (× bf16" in text
    assert "e5m2 / all / adamw: format shift in seed {0}, so its numbers are not e5m2's alone" in text
    spot = next(line for line in text.splitlines() if line.startswith("| mlp | adamw |"))
    assert spot.endswith("| e3m4 |") and "e3m4 ≈" not in spot and "e2m5" in spot  # e2m5 leads without it
    row = next(line for line in text.splitlines() if line.startswith("| e3m4 | adamw | mlp |"))
    assert row.endswith("| completed; format shift in seed {1} |")
    heatmap = plot_heatmap(compute_findings(load_experiment(exp)), "adamw", (), tmp_path / "heatmap.png")
    (texts,) = heatmap.texts.values()  # row by row: e2m5, e3m4, e4m3, e5m2, e6m1; columns all, mlp
    assert [i for i, t in enumerate(texts) if "format shift" in t] == [3, 6]  # e3m4 / mlp, e5m2 / all


def test_without_e5m2_all_the_verdict_takes_an_e5m2_cell_that_did_not_shift():
    """A grid without e5m2 / all is judged on an e5m2 cell that ran the full budget in its own
    format: attn's seed 0 shifted a layer, so mlp's is the one (helper-27)."""
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.0, 1.01, 1.02], prec="attn"),
               *seeded("e5m2", [1.0, 1.01, 1.02], prec="mlp")]
    records[3].events = [shift(10, "lm_head", "e5m2", "e4m3")]
    verdict = compute_findings(records).verdict
    assert verdict.passed and verdict.cell.precision == "mlp"


def test_a_shift_after_the_last_evaluation_leaves_the_cell_standing(tmp_path, capsys):
    """A shift at step s applies from step s + 1, so one at or after a run's last evaluation (step
    60 here) changed nothing it measured: its cell stays in the verdict and the sweet spot, and the
    note says why. One step earlier, before that evaluation, it does not."""
    def judged(shift_step: int) -> tuple[str, str]:
        records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.0, 1.01, 1.02], prec="attn"),
                   *seeded("e5m2", [1.2, 1.21, 1.22], prec="mlp")]
        records[3].events = [shift(shift_step, "lm_head", "e5m2", "e4m3")]
        f = compute_findings(records)
        return f.verdict.cell.precision, next(n for n in f.notes if "Emergency format shifts" in n)

    at_last, note = judged(STEPS)
    assert at_last == "attn" and note.endswith("No evaluation came after it, so nothing the run measured "
                                               "changed; the cell stands.")
    before, note = judged(STEPS - 1)
    assert before == "mlp" and "the cell is left out of the sweet spot and the verdict" in note


def test_the_warnings_runs_raised_are_listed_per_grid_point(tmp_path, capsys):
    """Warnings are events a run trains on (SPEC §5): which grid point raised which, in how many of
    its seeds, first when, how often -- up to the sweep's stop (a kurtosis spike after an ASHA stop
    is past the trial's result). A skipped non-finite step is among them; a resume is not one."""
    records = study()
    e3m4 = [r for r in records if r.format == "e3m4"]
    e3m4[0].events = [{"step": 7, "kind": "underflow_warn", "message": "..."},
                      {"step": 30, "kind": "underflow_warn", "message": "..."}]
    e3m4[2].events = [{"step": 4, "kind": "underflow_warn", "message": "..."},
                      {"step": 9, "kind": "nan_skip", "message": "...", "streak": 1}, {"step": 12, "kind": "resume"}]
    bf16 = records[0]
    bf16.events = [{"step": 50, "kind": "kurtosis_warn", "message": "..."}]
    f = compute_findings(records)
    assert [(w.format, w.precision, w.what, w.seeds, w.of, w.first, w.events) for w in f.warnings] == [
        ("bf16", "all", "activation kurtosis", (0,), 3, 50, 1),
        ("e3m4", "mlp", "non-finite step skipped", (2,), 3, 9, 1),
        ("e3m4", "mlp", "underflow", (0, 2), 3, 4, 3)]
    exp = write_experiment(tmp_path / "exp", records)
    (exp / STATE_DIR / "asha.json").write_text(json.dumps({"stopped": {bf16.trial_id: {"step": 40, "rung": 40}}}))
    assert main(["report", str(exp), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    section = text.split("## Warnings the runs raised")[1].split("\n## ")[0]
    assert "| e3m4 | adamw | mlp | — | underflow | {0, 2} of 3 | 4 | 3 |" in section
    assert "| e3m4 | adamw | mlp | — | non-finite step skipped | {2} of 3 | 9 | 1 |" in section
    assert "kurtosis" not in section  # raised at 50, after bf16 seed 0's stop at 40


def test_cli_writes_the_report(tmp_path, capsys):
    records = [*study(), trial("e7m0", "adamw", "all", 0.5, nan_from=37)]
    exp = write_experiment(tmp_path / "exp", records)
    assert main(["report", str(exp), "--out", str(tmp_path / "out")]) == 0
    assert "report written" in capsys.readouterr().out
    path = tmp_path / "out" / "report.md"
    text = path.read_text()
    assert text.startswith("# AltGrad report: exp")
    mean, hw = hand_interval([1.20, 1.21, 1.22])
    assert f"**E5M2 within 10 % of BF16: INVESTIGATE (× bf16 {mean:.3f} ± {hw:.3f} (n = 3, paired)" in text
    assert "- Sweet spot for **mlp, adamw**: tie: e3m4 ≈ e2m5 (intervals overlap; bf16 left out" in text
    assert "| e7m0_adamw_all_0 | e7m0 | adamw | all | — | 0 | nan | 37 (collapse) | forward (non-finite loss) |" in text
    assert "Nothing: every grid point has a finished trial." in text
    pngs = sorted(p.name for p in path.parent.glob("*.png"))
    assert pngs == sorted(f"{kind}_adamw.png" for kind in ("loss", "heatmap", "stability"))
    assert all((path.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in pngs)
    assert all((path.parent / name).stat().st_size > 5000 for name in pngs)
    assert all(f"]({name})" in text for name in pngs)
    assert text.index("## Plots") < text.index("## Sweet spot per layer precision") < text.index("## Failures and early stops")


def test_failure_sites_and_guides_use_each_runs_own_thresholds(tmp_path):
    """Two runs with the same overflow rate (0.05): one at the default warning level (0.01), one
    whose config raised it to 0.1. Read back from their config.yaml, only the first is a forward
    overflow, and the stability plot draws both runs' levels."""
    rates = {"quant/overflow_rate": 0.05, "quant/forward_overflow_rate": 0.05}
    default = trial("e2m5", seed=0, summary={"stop_reason": "asha"}, **rates)
    raised = trial("e2m5", seed=1, summary={"stop_reason": "asha"}, **rates)
    raised.stability = StabilityConfig(overflow_warn=0.1)
    exp = write_experiment(tmp_path / "exp", [trial("bf16"), default, raised])
    (run_dir(exp, raised) / "config.yaml").write_text(  # a field this version does not know is ignored
        (run_dir(exp, raised) / "config.yaml").read_text().replace("stability:\n", "stability:\n  retired_knob: 3\n"))
    records = load_experiment(exp)
    assert [r.stability.overflow_warn for r in records] == [0.01, 0.01, 0.1]
    for r in records:
        r.stop_reason = r.summary.get("stop_reason")
    f = compute_findings(records)
    sites = {fail.trial.seed: (fail.where, fail.evidence) for fail in f.failures}
    assert sites[0] == ("forward overflow", "quant/forward_overflow_rate = 0.05 > 0.01 at step 1")
    assert sites[1] == ("—", "no signal above threshold")
    plot = plot_stability(f, "adamw", (), tmp_path / "stability.png")
    assert plot.thresholds["all: quant/overflow_rate by pass"] == [0.01, 0.1]
    assert plot.thresholds["all: quant/bit_stall_rate"] == [0.5]


def test_the_stability_figure_draws_the_pass_a_failure_names(tmp_path):
    """A trial stopped with its gradients underflowing: the failure table says "backward underflow",
    and the figure draws that rate (backward, dashed) above its threshold, beside the forward's;
    the rate over both passes, which hides which pass it was, is not drawn for a run that has both."""
    rates = {"quant/overflow_rate": 0.002, "quant/underflow_rate": 0.2, "quant/forward_overflow_rate": 0.003,
             "quant/backward_overflow_rate": 0.001, "quant/forward_underflow_rate": 0.01,
             "quant/backward_underflow_rate": 0.6}
    stalled = replace(trial("e2m5", seed=0, **rates), stop_reason="asha")
    f = compute_findings([trial("bf16"), stalled])
    (failure,) = f.failures
    assert failure.where == "backward underflow"
    plot = plot_stability(f, "adamw", (), tmp_path / "stability.png")
    panel = "all: quant/underflow_rate by pass"
    drawn = {label: y for (p, label), (_, y) in plot.lines.items() if p == panel}
    assert set(drawn) == {"e2m5 s0 forward", "e2m5 s0 backward"}
    np.testing.assert_array_equal(drawn["e2m5 s0 backward"], stalled.series("quant/backward_underflow_rate")[1])
    assert (drawn["e2m5 s0 backward"] > max(plot.thresholds[panel])).all()
    assert {label for (p, label) in plot.lines if p == "all: quant/overflow_rate by pass"} == {
        "e2m5 s0 forward", "e2m5 s0 backward"}


def test_the_stability_figure_draws_the_dead_gradient_and_zero_update_fractions_the_table_reads(tmp_path):
    """The failure table names "backward underflow" from the dead-gradient fraction, a per-layer
    metric read as its mean over layers, and "optimizer stall" from the zero-update fraction: each
    has its row, drawn as the table reads it, with the run's own threshold (not the defaults, which
    are alike)."""
    dead = trial("e2m5", seed=0, **{"grad/dead_frac/h.0.mlp.c_fc": 0.9, "grad/dead_frac/lm_head": 0.6,
                                    "quant/zero_update_frac": 0.7})
    dead.history[3]["grad/dead_frac/lm_head"] = 0.2  # one row where the layers' mean is not a constant
    stopped = replace(dead, stop_reason="asha", stability=StabilityConfig(dead_grad_signal=0.3, zero_update_signal=0.6))
    f = compute_findings([trial("bf16"), stopped])
    (failure,) = f.failures
    assert failure.where == "backward underflow"
    plot = plot_stability(f, "adamw", (), tmp_path / "stability.png")
    x, y = plot.lines["all: grad/dead_frac, mean over layers", "e2m5 s0"]
    np.testing.assert_array_equal(x, range(1, STEPS + 1))
    np.testing.assert_allclose(y, [0.55 if step == 4 else 0.75 for step in x])
    assert plot.thresholds["all: grad/dead_frac, mean over layers"] == [0.3]
    x, y = plot.lines["all: quant/zero_update_frac", "e2m5 s0"]
    assert len(x) == STEPS and set(y) == {0.7}
    assert plot.thresholds["all: quant/zero_update_frac"] == [0.6]


def test_each_format_has_its_own_colour_and_none_is_grey():
    """bf16 is black and the seed bands grey: a grey format (e7m0's was tab10's grey) read as either."""
    from matplotlib.colors import to_rgb

    from altgrad.report.plots import color

    colours = [to_rgb(color(f"e{e}m{7 - e}")) for e in range(8)]
    assert len(set(colours)) == 8
    assert all(max(c) - min(c) > 0.2 for c in colours)  # chromatic: not black, grey or white
    assert to_rgb(color("bf16")) == (0, 0, 0)


def test_a_stopped_seed_does_not_end_its_cells_loss_curve(tmp_path):
    """A seed stopped at step 30 of 60 stays in its cell (its loss is the cell's result), so the
    seeds' band ends there; the seeds that went on are drawn on, each alone, to their last step."""
    by_pass = {"quant/forward_overflow_rate": 0.001, "quant/backward_overflow_rate": 0.002}
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.0, 1.01]),
               trial("e5m2", seed=2, scale=1.02, nan_from=31, **by_pass)]
    plot = plot_loss(compute_findings(records), "adamw", (), tmp_path / "loss.png")
    x, _ = plot.lines["precision: all", "e5m2"]
    assert x[-1] < 31
    alone = {label: xy for (panel, label), xy in plot.lines.items() if label.startswith("e5m2 s")}
    assert set(alone) == {"e5m2 s0 alone", "e5m2 s1 alone"}
    for seed in (0, 1):
        steps, values = records[3 + seed].val_series()
        ax, ay = alone[f"e5m2 s{seed} alone"]
        assert ax[0] == x[-1] and ax[-1] == STEPS
        np.testing.assert_array_equal(ay, [v for s, v in zip(steps, values, strict=True) if s >= x[-1]])
    assert not [label for _, label in plot.lines if label.startswith("bf16 s")]  # all of bf16 in its band
    # the stopped seed's collapse is marked once in each panel of the stability figure (two passes, one mark)
    stability = plot_stability(compute_findings(records), "adamw", (), tmp_path / "stability.png")
    assert stability.collapses and all(marks == [31] for marks in stability.collapses.values())


def test_the_second_half_marks_only_its_own_collapses(tmp_path):
    """A collapse at step 11 of 60 is marked on the whole run's panel, not on the second half's,
    where, drawn outside the axes, it landed over the panel beside it (another precision). Where
    every trial broke, the second half says so rather than zoom on the broken curves."""
    records = [*seeded("bf16", [1.0, 1.0]), *seeded("e4m3", [1.01, 1.02], prec="all"),
               trial("e5m2", prec="mlp", seed=0, nan_from=11), trial("e5m2", prec="mlp", seed=1, nan_from=12)]
    plot = plot_loss(compute_findings(records), "adamw", (), tmp_path / "loss.png")
    assert sorted(plot.collapses["precision: mlp"]) == [11, 12]
    assert not any(panel.endswith("steps 30-60") for panel in plot.collapses)
    assert plot.limits["precision: mlp, steps 30-60"][0] == (30, 60)  # on bf16's losses there
    broken = plot_loss(compute_findings(records[-2:]), "adamw", (), tmp_path / "broken.png")
    assert broken.texts == {"precision: mlp": ["broke: e5m2 (nan)"], "precision: mlp, steps 30-60": ["every trial broke"]}
    assert broken.limits["precision: mlp, steps 30-60"][0] == (30, 60)


def test_a_running_bf16_seed_behind_the_others_does_not_cut_the_reference_curve(tmp_path):
    """bf16's seed still running at step 30 of 60 is left out of its curve, as out of the tables
    (no baseline of a cell at 60 steps): the dashed reference runs to 60 over the seeds that got
    there, and nothing is drawn alone."""
    records = [*seeded("bf16", [1.0, 1.0]), trial("bf16", seed=2, status="RUNNING", steps=30),
               *seeded("e4m3", [1.01, 1.02, 1.03])]
    plot = plot_loss(compute_findings(records), "adamw", (), tmp_path / "loss.png")
    x, y = plot.lines["precision: all", "bf16"]
    assert x[-1] == STEPS
    np.testing.assert_allclose(y, [curve(int(step), 1.0) for step in x])
    assert not [label for _, label in plot.lines if label.endswith("alone")]


def test_a_stopped_bf16_seed_is_drawn_on_its_own_not_in_the_reference(tmp_path):
    """bf16's seed 2, NaN from step 31 (stopped at 35) of 60, is no baseline in the tables (a cell's × bf16 divides
    by seeds 0 and 1), so the dashed reference is their mean to step 60, not a band that ends where
    seed 2 broke with the others going on alone; seed 2 is drawn on its own and its collapse marked."""
    records = [*seeded("bf16", [1.0, 1.01]), trial("bf16", seed=2, scale=1.2, nan_from=31, steps=35),
               *seeded("e4m3", [1.01, 1.02, 1.03])]
    findings = compute_findings(records)
    (cell,) = findings.cells.values()
    assert cell.short_baseline == (2,)  # the tables' side of the same rule
    plot = plot_loss(findings, "adamw", (), tmp_path / "loss.png")
    x, y = plot.lines["precision: all", "bf16"]
    assert x[-1] == STEPS
    np.testing.assert_allclose(y, [curve(int(step), 1.005) for step in x])
    assert not [label for _, label in plot.lines if label.endswith("alone")]
    own = plot.lines["precision: all", "bf16 s2: nan at step 31, not the reference"]  # where it broke
    steps, values = records[2].val_series()
    np.testing.assert_array_equal(own[0], steps)
    np.testing.assert_array_equal(own[1], values)
    assert plot.collapses["precision: all"] == [31]


def test_a_bad_threshold_in_a_runs_config_makes_that_trial_unreadable(tmp_path):
    exp = write_experiment(tmp_path / "exp", [trial("bf16"), trial("e4m3")])
    config = run_dir(exp, trial("e4m3")) / "config.yaml"
    config.write_text(config.read_text().replace("overflow_warn: 0.01", "overflow_warn: 7"))
    records = load_experiment(exp)
    assert records[0].unreadable is None
    assert "overflow_warn" in records[1].unreadable and records[1].status == "ERROR"
    # its failure row says why it has no numbers, not "no metrics recorded" at step "None"
    text = write_report(records, tmp_path / "report").read_text()
    row = next(line for line in text.split("## Failures and early stops")[1].splitlines() if "e4m3" in line)
    assert "| error | — | unknown | its files could not be read: " in row and "overflow_warn" in row
    assert "None" not in row and "no metrics recorded" not in row
    # its cell is broken, not "not evaluated yet", in the table and on the heatmap
    cells = text.split("## All cells")[1].split("\n## ")[0]
    assert "not evaluated yet" not in cells and "| e4m3 | adamw | all |" in cells
    heat = plot_heatmap(compute_findings(records), "adamw", (), tmp_path / "heat.png")
    assert "× error" in heat.texts["Best val loss / bf16 — optimizer adamw"]


def test_cli_partial_experiment_says_what_is_missing(tmp_path):
    records = [trial("bf16"), trial("e4m3"), trial("e5m2", status="PENDING", steps=0),
               trial("e2m5", status="RUNNING", steps=20)]
    assert main(["report", str(write_experiment(tmp_path / "exp", records))]) == 0
    missing = (tmp_path / "exp" / "report" / "report.md").read_text().split("## What is missing")[1]
    assert f"{records[2].trial_id} ({records[2].format} / adamw / all): not started" in missing
    assert f"{records[3].trial_id} ({records[3].format} / adamw / all): still running at step 20" in missing


@pytest.mark.parametrize("case", ["no such dir", "not an experiment", "empty experiment"])
def test_cli_bad_input_exits_2(tmp_path, capsys, case):
    exp = tmp_path / "exp"
    if case == "not an experiment":
        exp.mkdir()
    elif case == "empty experiment":
        write_experiment(exp, [trial("bf16", status="PENDING", steps=0)])
    assert main(["report", str(exp)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(exp) in err
    assert ("no trial has recorded any metrics" if case == "empty experiment" else "not an AltGrad experiment") in err
    assert not (exp / "report").exists()


def test_cli_corrupt_trial_file_exits_2(tmp_path, capsys):
    exp = write_experiment(tmp_path / "exp", study())
    metrics = run_dir(exp, trial("e4m3")) / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([*lines[:5], "{not json", *lines[5:]]) + "\n")
    assert main(["report", str(exp)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl: line 6 is not valid JSON" in err


def test_cli_corrupt_trial_never_hides_the_others(tmp_path, capsys):
    exp = write_experiment(tmp_path / "exp", study())
    (run_dir(exp, trial("e4m3")) / "summary.json").write_text("{not json")
    assert main(["report", str(exp)]) == 2
    assert "e4m3_adamw_all_0" in capsys.readouterr().err
    text = (exp / "report" / "report.md").read_text()
    assert "| e5m2 | adamw | all |" in text and "e4m3_adamw_all_0" in text.split("## What is missing")[1]


@pytest.mark.slow
@pytest.mark.ray
def test_tiny_sweep_with_an_axis_and_seeds(ray_address, eurlex_dir, data_root, tmp_path, capsys):
    """A real sweep with an extra axis and two seeds: e1m6 is measured by e0m7's trials, the table,
    the keys and the report's cells carry the axis, and the report's numbers match the trial data
    (stops for NaN are tested in test_sweep_ray.py)."""
    from altgrad.report.cli import report_after_sweep
    from altgrad.trial_table import render_table, to_csv, trial_row
    from altgrad.tune.ablation import FormatAblation
    from altgrad.tune.cli import sweep_main

    sets = [
        "preset=cpu", "grid.formats=[bf16, e0m7, e1m6]", "grid.optimizers=[adamw]", "grid.precisions=[all]",
        "grid.seeds=[1, 2]", "grid.axes={quant.rounding: [nearest, stochastic]}",
        f"base.data.source=jsonl:{eurlex_dir}", f"base.data.data_root={data_root}", "base.data.max_docs=40",
        "base.model={n_layer: 1, n_head: 2, n_embd: 32, block_size: 16}", "base.train.batch_size=2",
        "base.train.max_steps=20", "base.train.warmup_steps=2", "base.train.eval_interval=5",
        "base.train.eval_iters=2", "base.train.checkpoint_interval=10", "asha.grace_period=10",
        "base.stability.nan_patience=3", "wandb.enabled=false", "dashboard.enabled=false",
    ]
    config = Path(__file__).resolve().parents[1] / "sweeps" / "configs" / "format_ablation.yaml"
    argv = [a for s in sets for a in ("--set", s)] + ["--name", "tiny", "--storage-path", str(tmp_path)]
    assert sweep_main(FormatAblation, config, "test", argv, after=report_after_sweep) == 0
    out = capsys.readouterr().out
    assert "6 trials (+4 listed under an equivalent format or precision)" in out  # 2 bf16 + e0m7 x 2 roundings x 2
    exp = tmp_path / "tiny"
    records = load_experiment(exp)
    keys = [r.key for r in records]
    assert "e0m7-adamw-all-rounding=stochastic-s2" in keys and "bf16-adamw-all-s1" in keys
    alias = next(r for r in records if r.key == "e1m6-adamw-all-rounding=stochastic-s2")
    assert alias.same_as == "e0m7-adamw-all-rounding=stochastic-s2"
    measured = next(r for r in records if r.key == alias.same_as)
    assert alias.history == measured.history and alias.format == "e1m6"
    rows = [trial_row(r) for r in records]
    assert {row["quant.rounding"] for row in rows if row["format"] != "bf16"} == {"nearest", "stochastic"}
    assert "rounding" in render_table(rows).splitlines()[0] and "quant.rounding" in to_csv(rows).splitlines()[0]

    text = (exp / "report" / "report.md").read_text()
    f = compute_findings(records)
    cell = f.cells["e0m7", "adamw", "all", (("quant.rounding", "stochastic"),)]
    assert cell.name == "e0m7 ≡ e1m6" and cell.ratio.n == 2 and cell.ratio.paired
    bf16 = {r.seed: r for r in records if r.format == "bf16"}
    ratios = [min(filter(math.isfinite, t.val_series()[1])) / min(filter(math.isfinite, bf16[t.seed].val_series()[1]))
              for t in cell.trials]
    assert cell.ratio.mean == pytest.approx(sum(ratios) / 2)
    assert "| e0m7 ≡ e1m6 | adamw | all | rounding=stochastic | 1, 2 |" in text
    assert "## Extra grid axes" in text and "rounding: stochastic − nearest" in text
    assert (exp / "report" / "heatmap_adamw_rounding-stochastic.png").stat().st_size > 5000
    assert main(["report", str(exp), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.md").read_text().split("\n", 1)[1] == text.split("\n", 1)[1]


def publish_study():
    """The module of `sweeps/publish_study.py` (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("publish_study", ROOT / "sweeps" / "publish_study.py")
    publish = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(publish)
    return publish


def test_the_published_study_names_the_code_its_trials_ran(tmp_path):
    """Trials of one study that ran different code (a sweep resumed after a commit) are named
    with their commits, not with whatever the checkout held when the sweep last wrote its state."""
    publish = publish_study()
    records = study()
    exp = write_experiment(tmp_path / "exp", records)
    state = json.loads((exp / STATE_DIR / SWEEP_FILE).read_text())
    (exp / STATE_DIR / SWEEP_FILE).write_text(json.dumps({**state, "commit": "ccc3333", "updated": 2000.0}))
    readme = tmp_path / "README.md"
    for commits, said in ((["aaa1111"] * 12 + ["bbb2222"] * 6, "its trials ran commits aaa1111 (12 trials), bbb2222 (6 trials)"),
                          (["aaa1111"] * 18, "its trials ran commit aaa1111"),
                          ([None] * 18, "the sweep ran commit ccc3333")):  # workers from before they said
        for i, (r, commit) in enumerate(zip(records, commits, strict=True)):
            worker = {"started": 1000.0 + i, **({"commit": commit} if commit else {})}
            (exp / TRIALS_DIR / r.trial_id / WORKER_FILE).write_text(json.dumps(worker))
        readme.write_text("# x\n<!-- study:begin -->\nSTALE SECTION\n<!-- study:end -->\nafter\n")
        stale = tmp_path / publish.IMAGES / "heatmap_adamw_grad_format-e4m3.png"  # an earlier study's facet
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_bytes(b"png")
        assert publish.main([str(exp), "--readme", str(readme)]) == 0
        text = readme.read_text()
        assert f"; {said}: 18 trials, seeds 0, 1, 2;" in text and "STALE" not in text and text.endswith("after\n")
        assert "\n- Gradients against the FP32 shadow, all, adamw: closest to FP32: e4m3 " in text
        shown = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
        assert shown and sorted(p.name for p in (tmp_path / publish.IMAGES).iterdir()) == sorted(Path(s).name for s in shown)
    proc = subprocess.run([sys.executable, str(ROOT / "sweeps" / "publish_study.py"), str(exp),
                           "--readme", str(tmp_path / "NOPE.md")], capture_output=True, text=True)
    assert proc.returncode == 2 and "--readme" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "NOPE.md").exists()


def test_a_readme_that_is_not_utf8_is_refused_untouched(tmp_path, capsys):
    """Rewritten, a Latin-1 README would be mangled: exit 2 naming the file and line, not
    UnicodeDecodeError's traceback, before the experiment is read or anything is written."""
    publish = publish_study()
    readme = tmp_path / "README.md"
    latin1 = "# x\n<!-- study:begin -->\ncafé\n<!-- study:end -->\n".encode("latin-1")
    readme.write_bytes(latin1)
    assert publish.main([str(tmp_path / "exp"), "--readme", str(readme)]) == 2
    assert capsys.readouterr().err == f"error: {readme}: line 3 is not UTF-8 text (invalid continuation byte); " \
                                      "save the file as UTF-8\n"
    assert readme.read_bytes() == latin1 and not (tmp_path / publish.IMAGES).exists()


def test_publishing_checks_the_readme_and_the_experiment_before_writing_anything(tmp_path, capsys):
    """README markers out of order, or a sweep file that is not JSON: exit 2 with a message, and
    neither the README nor the report nor the README's images are touched."""
    publish = publish_study()
    exp = write_experiment(tmp_path / "exp", study())
    readme = tmp_path / "README.md"
    out_of_order = "# x\n<!-- study:end -->\nold\n<!-- study:begin -->\n"
    readme.write_text(out_of_order)
    assert publish.main([str(exp), "--readme", str(readme)]) == 2
    assert "has no <!-- study:begin --> ... <!-- study:end --> section (in that order)" in capsys.readouterr().err
    assert readme.read_text() == out_of_order
    in_order = "# x\n<!-- study:begin -->\nold\n<!-- study:end -->\n"
    readme.write_text(in_order)
    (exp / STATE_DIR / SWEEP_FILE).write_text("{not json")
    assert publish.main([str(exp), "--readme", str(readme)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {exp}: cannot read the experiment: ")
    assert readme.read_text() == in_order
    assert not (exp / "report").exists() and not (tmp_path / publish.IMAGES).exists()


def test_the_heatmap_draws_bf16_s_level_in_the_middle_colour_whatever_the_range(tmp_path):
    """× bf16 = 1 is the colour map's middle and each side its own colours: a range wider below 1
    than above (a format 17 % better) must not draw a cell no different from bf16 in the "worse"
    half, as a scale from the data's minimum to its maximum did."""
    from matplotlib import colormaps

    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e3m4", [0.82, 0.83, 0.84]),
               *seeded("e4m3", [0.999, 1.0, 1.001]), *seeded("e5m2", [1.02, 1.03, 1.04])]
    heat = plot_heatmap(compute_findings(records), "adamw", (), tmp_path / "heat.png")
    (shades,) = heat.shades.values()  # rows e3m4, e4m3, e5m2; one column (all)
    np.testing.assert_allclose(shades[1, 0], colormaps["RdYlGn_r"](0.5))
    better, worse = shades[0, 0], shades[2, 0]
    assert better[1] > better[0] and worse[0] > worse[1]  # green above red, red above green
    # one distance from 1, one depth of colour on either side (not each side scaled to its extreme)
    norm = ratio_norm(np.array([0.83, 1.0, 1.03]))
    assert norm(0.9) - 0.5 == pytest.approx(0.5 - norm(1.1)) and 0.5 < norm(1.03) < 0.6


def test_a_format_s_own_settings_are_said_where_its_numbers_are_read(tmp_path):
    """A format that ran with settings of its own (`grid.format_overrides`, here a learning rate)
    is compared with bf16 at the base's: the notes say so by format, and the verdict names them."""
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.01, 1.02, 1.03]),
               *seeded("e4m3", [1.0, 1.01, 1.02])]
    for r in records:
        if r.format == "e5m2":
            r.overrides = {"optim.lr": 0.001, "quant.master_weights": "format"}
    f = compute_findings(records)
    (said,) = [n for n in f.notes if n.startswith("**Settings by format**")]
    assert "e5m2 ran with `optim.lr` = 0.001, `quant.master_weights` = format" in said and "e4m3" not in said
    assert "e5m2 / all / adamw (with `optim.lr` = 0.001, `quant.master_weights` = format)" in f.verdict.line
    assert said in write_report(records, tmp_path).read_text()
    assert not [n for n in compute_findings(seeded("bf16", [1.0]) + seeded("e5m2", [1.0])).notes
                if "Settings by format" in n]


def test_better_than_bf16_under_an_optimizer_that_took_adamw_s_bf16_steps_points_at_the_optimizer():
    """manifold's bf16 trials are adamw's training (no format's ULPs to step in): a manifold cell
    better than bf16 holds the optimizer's own effect, so its note points at manifold − adamw with
    its numbers, not at the format's roles, which stays the advice for an adamw cell."""
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("bf16", [1.0, 1.0, 1.0], "manifold"),
               *seeded("e5m2", [1.0, 1.01, 1.02]), *seeded("e5m2", [0.82, 0.83, 0.84], "manifold"),
               *seeded("e4m3", [0.90, 0.91, 0.92])]
    f = compute_findings(records)
    (manifold,) = [n for n in f.notes if n.startswith("e5m2 / all / manifold trained better")]
    (delta,) = [d for d in f.deltas if d.b.format == "e5m2"]
    assert "took `adamw`'s steps" in manifold and f"manifold − adamw there is {delta.diff.text(4)}" in manifold
    assert "forward-only" not in manifold
    (adamw,) = [n for n in f.notes if n.startswith("e4m3 / all / adamw trained better")]
    assert "forward-only quantization" in adamw


def test_a_cell_stopped_for_trailing_bf16_is_drawn_as_broken_not_as_a_healthy_curve(tmp_path):
    """Seeds ASHA stopped at step 20 of 60 (finite losses, no collapse to mark) end their curve there
    like a run that finished early: the panel says the format broke, and why (in the panel: the
    legend is the figure's, one entry a format whatever the precision), and a mark on the top edge,
    apart from the collapses', stands at each stop, in the whole run's panel and not the second
    half's."""
    records = [*seeded("bf16", [1.0, 1.0, 1.0]),
               *(diverged(s, k, stop_at=20) for s, k in enumerate([1.2, 1.3, 1.4])), *seeded("e5m2", [1.0, 1.01, 1.02])]
    plot = plot_loss(compute_findings(records), "adamw", (), tmp_path / "loss.png")
    assert ("precision: all", "e4m3") in plot.lines and ("precision: all", "e5m2") in plot.lines
    assert plot.texts["precision: all"] == ["broke: e4m3 (asha)"]
    assert plot.stops == {"precision: all": [20, 20, 20]} and not plot.collapses


def test_a_gradient_tie_says_which_member_s_own_cosine_bf16_s_separates():
    """Like a sweet spot tied with bf16: e4m3 leads the formats closest to FP32 and e5m2 ties with
    it, yet e4m3's own cosine − bf16 lies below 0; the line says so rather than read as "all as
    close as they come"."""
    records = [*(trial("bf16", seed=s, cos=c) for s, c in enumerate([0.999, 0.998, 0.999])),
               *(trial("e4m3", seed=s, cos=c) for s, c in enumerate([0.990, 0.991, 0.989])),
               *(trial("e5m2", seed=s, cos=c) for s, c in enumerate([0.999, 0.95, 0.99]))]
    f = compute_findings(records)
    (line,) = f.fidelity_summary()
    g = next(g for g in f.fidelity if g.cell.format == "e4m3")
    assert g.diff.hi < 0 and "closest to FP32: e4m3" in line and "≈ e5m2" in line
    assert "(intervals overlap; yet e4m3 lower than bf16" in line and "yet e5m2" not in line


def test_a_cells_gradient_cosine_is_not_compared_where_its_seeds_stopped_at_different_steps():
    """As its × bf16: a cell whose seeds stopped at different steps has a cosine − bf16 whose spread
    is the budgets' as much as the seeds'; it is not called, nor counted in the Holm family."""
    broke = replace(trial("e5m2", seed=2, scale=1.25, steps=30), stop_reason="asha")
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.0, 1.001]), broke,
               *seeded("e4m3", [1.01, 1.02, 1.03])]
    f = compute_findings(records)
    mixed, other = (next(g for g in f.fidelity if g.cell.format == fmt) for fmt in ("e5m2", "e4m3"))
    assert mixed.verdict == "not compared (seeds stopped at different steps)" and mixed.family_wise is None
    assert other.family_wise.family == 1


def test_a_manifold_difference_not_taken_is_said_with_why(tmp_path):
    """manifold − adamw needs both sides at full budget: a format whose manifold seeds broke has
    none, and the section says which and why instead of leaving the row out unsaid."""
    stopped = [replace(trial("e4m3", "manifold", seed=s, steps=30), stop_reason="asha") for s in range(3)]
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.0, 1.01, 1.02]),
               *seeded("e5m2", [0.98, 0.99, 1.0], "manifold"), *seeded("e4m3", [1.0, 1.01, 1.02]), *stopped]
    f = compute_findings(records)
    assert [d.a.format for d in f.deltas] == ["e5m2"]
    assert f.deltas_left_out() == ["e4m3 / all (manifold: asha)"]
    assert "Not compared, a side broke or ran short: e4m3 / all (manifold: asha)." in \
        write_report(records, tmp_path).read_text()


def test_a_seed_stopped_at_the_final_evaluation_measured_the_budget_and_is_compared():
    """bit-stall stopped every seed at step 60 of 60, after the last evaluation: each best val loss
    covers the whole budget, so the cell is compared with bf16 as any other (its stops still say
    why, and the sweet spot still wants an unbroken cell)."""
    stalled = [replace(t, stop_reason="bit_stall") for t in seeded("e7m0", [0.95, 0.96, 0.97])]
    f = compute_findings([*seeded("bf16", [1.0, 1.0, 1.0]), *stalled])
    cell = f.cells["e7m0", "adamw", "all", ()]
    assert cell.broke and not cell.broke_early and cell.at_stop is None
    assert cell.vs_bf16 == "better" and cell.family_wise.family == 1 and cell.stops == ("bit_stall",)
    assert spot(f, "all").group == ()  # broke: not eligible


def test_the_loss_at_the_stop_pairs_a_seed_only_with_bf16_s_loss_at_its_step():
    """e4m3 1.3x bf16 throughout, seed 0 stopped at step 20, seed 1 at step 50, where bf16's seed 1
    (stopped at 30) has no evaluation: seed 1 is left out, not divided unpaired by a loss at
    another step (which read 1.09x)."""
    records = [trial("bf16", seed=0), trial("bf16", seed=1, steps=30),
               replace(trial("e4m3", seed=0, scale=1.3, steps=20), stop_reason="asha"),
               replace(trial("e4m3", seed=1, scale=1.3, steps=50), stop_reason="asha")]
    cell = compute_findings(records).cells["e4m3", "adamw", "all", ()]
    assert cell.at_stop.n == 1 and cell.at_stop.mean == pytest.approx(1.3)


def test_a_stall_during_the_warm_up_is_no_failure_site():
    """The learning-rate warm-up's first steps stall by construction (bit-stall 0.9 at step 1): a
    trial stopped at step 40 with nothing above its thresholds since is "—", not an optimizer stall
    at step 1; overflow at step 1 is still found."""
    record = trial("e5m2", summary={"stop_reason": "asha"}, steps=40)
    for row in record.history:
        row["quant/bit_stall_rate"] = 0.9 if row["step"] == 1 else 0.1
    record.stop_reason = "asha"
    assert compute_findings([trial("bf16"), record]).failures[0].where == "—"
    record.history[0]["quant/forward_overflow_rate"] = 0.5
    (failure,) = compute_findings([trial("bf16"), record]).failures
    assert failure.where == "forward overflow" and failure.evidence.endswith("= 0.5 > 0.01 at step 1")


def test_bf16_s_own_settings_are_said_apart_from_the_formats():
    """bf16 run with settings of its own is every ratio's divisor: the notes say so apart from the
    formats' settings, and the verdict line names both sides'."""
    records = [*seeded("bf16", [1.0, 1.0]), *seeded("e5m2", [1.01, 1.02])]
    for r in records:
        r.overrides = {"optim.lr": 0.01} if r.format == "bf16" else {"optim.lr": 0.002}
    notes = compute_findings(records).notes
    assert any(n.startswith("**Settings by format**") and "e5m2 ran with `optim.lr` = 0.002" in n
               and "against bf16 with its own (below)" in n and "bf16 ran" not in n for n in notes)
    assert "**bf16 ran with settings of its own** (`grid.format_overrides`): `optim.lr` = 0.01." in " ".join(notes)
    assert ("e5m2 / all / adamw (with `optim.lr` = 0.002), against bf16 with `optim.lr` = 0.01"
            in compute_findings(records).verdict.line)


def test_a_tie_bf16_leads_says_which_formats_it_left_out_on_calls_that_do_not_hold():
    """A two-seed sweep's sweet spot read "tie: bf16 ≈ e7m0": e7m0 (1.026 ± 0.044) tied by its
    width, while e4m3 (1.0004 ± 0.0003) was left out as worse on a call that did not hold
    family-wise. The tie now names those left out so (e4m3 here, not e5m2, whose call holds)."""
    records = [r for r in family_study() if r.format in ("bf16", "e4m3", "e5m2")]
    f = compute_findings([*records, *seeded("e7m0", [0.95, 1.05, 1.10])])
    tie = spot(f, "all")
    assert (tie.leader, tie.group) == (None, ("bf16", "e7m0"))
    assert not f.cells["e4m3", "adamw", "all", ()].family_wise.holds
    assert tie.text == "tie: bf16 ≈ e7m0 (intervals overlap; e4m3 left out as worse than bf16, not family-wise)"


def test_an_axis_effect_not_taken_is_said_with_why(tmp_path):
    """An extra axis's effect needs both values at full budget: where stored-in-format weights
    stalled (the axis's real effect), the section says which pair and why instead of dropping it."""
    records = seeded("bf16", [1.0, 1.0, 1.0])
    for weights, cells in (("fp32", [seeded("e5m2", [1.0, 1.01, 1.02]), seeded("e4m3", [1.0, 1.01, 1.02])]),
                           ("format", [seeded("e5m2", [1.03, 1.04, 1.05]),
                                       [replace(trial("e4m3", seed=s, steps=30), stop_reason="bit_stall")
                                        for s in range(3)]])):
        for r in (r for cell in cells for r in cell):
            r.axes = {"quant.master_weights": weights}
            records.append(r)
    f = compute_findings(records)
    assert [d.a.format for d in f.axis_effects] == ["e5m2"]
    line = "e4m3 / all, adamw: master_weights: format − fp32 (format: bit_stall)"
    assert f.axis_effects_left_out() == [line]
    assert f"Not compared, a side broke or ran short: {line}." in write_report(records, tmp_path).read_text()


def test_bf16_leading_says_every_eligible_format_is_worse_and_names_those_not_eligible():
    """"every format is worse" where a format was not eligible (it broke) overstated: it says
    every eligible one, and names the others."""
    stopped = [replace(trial("e7m0", seed=s, steps=30), stop_reason="asha") for s in range(3)]
    f = compute_findings([*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.20, 1.21, 1.22]), *stopped])
    assert spot(f, "all").text == "bf16 (every eligible format is worse; not eligible: e7m0)"
    f = compute_findings([*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.20, 1.21, 1.22])])
    assert spot(f, "all").text == "bf16 (every format is worse)"


def test_better_than_bf16_with_settings_of_its_own_points_at_the_settings():
    """A format that ran with its own learning rate and trained better than bf16 at the base's:
    the note names the settings as the first suspect, not published FP8 results; where bf16 ran
    with the same settings, the gain is the format's and the anomaly note stands."""
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [0.90, 0.91, 0.92])]
    for r in records:
        r.overrides = {"optim.lr": 0.005} if r.format == "e5m2" else {}
    (note,) = [n for n in compute_findings(records).notes if "trained better" in n]
    assert "It ran with `optim.lr` = 0.005, bf16 with the base's settings (`grid.format_overrides`): the gain may " \
           "be the settings'" in note and "Published FP8" not in note
    for r in records:  # bf16's own settings alone are as much a suspect
        r.overrides = {"optim.lr": 0.0005} if r.format == "bf16" else {}
    (note,) = [n for n in compute_findings(records).notes if "trained better" in n]
    assert "It ran with the base's settings, bf16 with `optim.lr` = 0.0005" in note
    for r in records:
        r.overrides = {"optim.lr": 0.005}
    (note,) = [n for n in compute_findings(records).notes if "trained better" in n]
    assert "Published FP8 results run slightly worse" in note


def test_the_loss_at_the_stop_is_the_broken_seeds_not_mixed_with_those_that_ran_the_budget():
    """One seed of three broke at step 30 (2.2x bf16's loss there), the others ran the full budget
    at 0.9x: "how far behind it was when it stopped" is the broken seed's 2.2, not the three's mean
    (1.33, which read as a format roughly on par)."""
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), trial("e4m3", seed=0, scale=0.9), diverged(1, 2.2),
               trial("e4m3", seed=2, scale=0.9)]
    cell = compute_findings(records).cells["e4m3", "adamw", "all", ()]
    assert cell.broke_seeds == (1,) and cell.at_stop.n == 1 and cell.at_stop.mean == pytest.approx(2.2)
    assert cell.vs_bf16 == ("not compared (broke before the final evaluation: asha; val loss at the last evaluation "
                            "of seed 1 2.20 (n = 1, paired, no interval) × bf16's there; seeds {0, 2} ran to the final evaluation; "
                            "seeds stopped at different steps)")


def test_a_precision_that_measures_what_another_does_is_one_cell_twice_and_one_family_member(tmp_path):
    """e5m2 / attn_e5m2 (attention in e5m2, the rest in the grid's format) is e5m2 / all: the grid
    runs it once and lists the trials under both. The report has the cell in both precisions, with
    one set of numbers, says so, and counts it once in each Holm family (twice, it made the family
    bigger and moved a call that held to one that did not)."""
    def keyed(records, prec):
        return [replace(r, key=f"{r.format}-adamw-{prec}-s{r.seed}") for r in records]
    e5m2 = keyed(seeded("e5m2", [1.05, 1.06, 1.07]), "all")
    records = [*keyed(seeded("bf16", [1.0, 1.0, 1.0]), "all"), *keyed(seeded("e3m4", [1.0, 1.01, 1.02]), "all"),
               *keyed(seeded("e3m4", [1.02, 1.03, 1.04], prec="attn_e5m2"), "attn_e5m2"), *e5m2,
               *(replace(r, key=f"e5m2-adamw-attn_e5m2-s{r.seed}", precision="attn_e5m2", same_as=r.key) for r in e5m2)]
    f = compute_findings(records)
    twin, cell = f.cells["e5m2", "adamw", "attn_e5m2", ()], f.cells["e5m2", "adamw", "all", ()]
    assert twin.twin_of == "all" and twin.ratio == cell.ratio and twin.family_wise is cell.family_wise
    assert cell.family_wise.family == 3 and not f.aliases
    assert f.multiplicity()[0].startswith("× bf16: 3 comparisons with an interval")
    # e5m2 is eligible there too, and each ranking under attn_e5m2 says whose trials its e5m2 are
    assert spot(f, "attn_e5m2").text.startswith("bf16 (every format is worse")
    assert spot(f, "attn_e5m2").text.endswith("[e5m2: the trials of e5m2 / all]")
    assert "[" not in spot(f, "all").text
    grads = {line.split(":")[0]: line for line in f.fidelity_summary()}
    assert grads["attn_e5m2, adamw"].endswith(") [e5m2: the trials of e5m2 / all]") and "[" not in grads["all, adamw"]
    panels = plot_loss(f, "adamw", (), tmp_path / "loss.png").texts
    assert panels.get("precision: attn_e5m2") == ["e5m2: the trials of e5m2 / all"] and "precision: all" not in panels
    text = write_report(records, tmp_path).read_text()
    assert ("e5m2 / attn_e5m2 quantizes the same layers in the same formats as e5m2 / all: one measurement") in text
    assert "| e5m2 | adamw | attn_e5m2 ≡ all | — | 0, 1, 2 |" in text
    # its warnings are listed under both precisions too, as the note says
    assert {(w.precision, w.what) for w in compute_findings([*records[:3], *(
        replace(r, events=[{"step": 5, "kind": "overflow_warn"}]) for r in records[3:])]).warnings
        if w.format == "e5m2"} == {("all", "overflow"), ("attn_e5m2", "overflow")}
    # listed first, `attn_e5m2` is measured and `all` its twin: the verdict's cell says whose trials
    swapped = [replace(r, precision={"all": "attn_e5m2", "attn_e5m2": "all"}[r.precision])
               if r.format == "e5m2" else r for r in records]
    swapped = [replace(r, same_as=r.key.replace("attn_e5m2", "all") if r.same_as else None) for r in swapped]
    verdict = compute_findings(swapped).verdict
    assert verdict.cell.twin_of == "attn_e5m2" and verdict.reason.startswith("e5m2 / all ≡ attn_e5m2 / adamw")


def test_a_sweet_spot_marks_only_the_twins_it_ranked(tmp_path):
    """A twin cell that broke is not eligible for its precision's sweet spot: the ranking does not
    name it, so it does not say whose trials it has."""
    e5m2 = [replace(r, key=f"e5m2-adamw-all-s{r.seed}") for r in (trial("e5m2", seed=s, nan_from=30) for s in range(3))]
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e3m4", [1.0, 1.01, 1.02], prec="attn_e5m2"), *e5m2,
               *(replace(r, key=f"e5m2-adamw-attn_e5m2-s{r.seed}", precision="attn_e5m2", same_as=r.key) for r in e5m2)]
    f = compute_findings(records)
    assert f.cells["e5m2", "adamw", "attn_e5m2", ()].twin_of == "all"
    assert "e5m2" in spot(f, "attn_e5m2").excluded and "trials of" not in spot(f, "attn_e5m2").text


def test_bit_stall_names_the_optimizer_as_the_failure_site_only_for_weights_stored_in_their_format():
    """Over fp32 master weights healthy runs stall most of their 8-bit view's updates (the master
    keeps them): an ASHA stop there was put down to an optimizer stall. Only a run whose weights are
    stored in their format loses a stalled update, and only there is bit-stall the site."""
    record = trial("e5m2", summary={"stop_reason": "asha"}, steps=40)
    for row in record.history:
        row["quant/bit_stall_rate"] = 0.9
    record.stop_reason = "asha"
    assert compute_findings([trial("bf16"), record]).failures[0].where == "—"
    (failure,) = compute_findings([trial("bf16"), replace(record, stored_in_format=True)]).failures
    assert failure.where == "optimizer stall" and "quant/bit_stall_rate = 0.9 > 0.5" in failure.evidence


def test_an_equivalent_format_of_a_precision_twin_reads_the_twin_cell():
    """e1m6 ≡ e0m7 and `mine` ≡ `all`: one measurement (e0m7 / all) under four names. e1m6 / mine
    reads the `mine` cell, which is e0m7 / all's numbers, named `e0m7 ≡ e1m6`."""
    base = [replace(r, key=f"e0m7-adamw-all-s{r.seed}") for r in seeded("e0m7", [1.05, 1.06, 1.07])]
    records = [*seeded("bf16", [1.0, 1.0, 1.0]), *base]
    for fmt, prec in (("e1m6", "all"), ("e0m7", "mine"), ("e1m6", "mine")):
        records += [replace(r, key=f"{fmt}-adamw-{prec}-s{r.seed}", format=fmt, precision=prec, same_as=r.key)
                    for r in base]
    f = compute_findings(records)
    assert f.aliases == {"e1m6": "e0m7"} and set(f.cells) == {("e0m7", "adamw", p, ()) for p in ("all", "mine")}
    mine = f.cell("e1m6", "adamw", "mine", ())
    assert mine.twin_of == "all" and mine.name == "e0m7 ≡ e1m6" and mine.ratio == f.cells["e0m7", "adamw", "all", ()].ratio
    assert mine.family_wise.family == 1


def printed_interval(text: str) -> tuple[Decimal, Decimal]:
    """The ends a reader works out of 'm ± h' (the first such pair in `text`, any separator)."""
    m, h = re.search(r"(-?\d+\.\d+)\s*±\s*(\d+\.\d+)", text).groups()
    return Decimal(m) - Decimal(h), Decimal(m) + Decimal(h)


def test_every_printer_of_a_ratio_puts_its_ends_where_the_call_reads_them(tmp_path):
    """e5m2 at 1.01 ± 0.00996 over bf16 excludes 1 by 4e-5 ('worse'), and at 1.08 ± 0.02004 its
    interval reaches 1.10004, past the verdict's 1.10 (INVESTIGATE): at 3 places both print with
    an end on the line ('1.010 ± 0.010', '1.080 ± 0.020'), which reads as the opposite call. The
    cells table, the heatmap and the verdict line print them with the places that keep the ends on
    their sides."""
    spread = 0.00401  # 1.01 ± t(0.975, 2) x spread / sqrt(3): a lower end of 1.00004
    worse = compute_findings([*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.01 - spread, 1.01, 1.01 + spread])])
    cell = worse.cells["e5m2", "adamw", "all", ()]
    assert cell.vs_bf16 == "worse"
    heat = plot_heatmap(worse, "adamw", (), tmp_path / "heat.png")
    (annotation,) = [t for t in heat.texts["Best val loss / bf16 — optimizer adamw"] if "±" in t]
    for printed in (cell.ratio.text(3), annotation, worse.verdict.line):
        assert printed_interval(printed)[0] > 1, printed

    spread = 0.02004 * math.sqrt(3) / 4.302653  # 1.08 ± 0.02004: reaches 1.10004
    over = compute_findings([*seeded("bf16", [1.0, 1.0, 1.0]), *seeded("e5m2", [1.08 - spread, 1.08, 1.08 + spread])])
    assert not over.verdict.passed and "reaches 1.1000" in over.verdict.line
    assert printed_interval(over.verdict.line)[1] > Decimal("1.10"), over.verdict.line
