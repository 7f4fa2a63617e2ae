"""The report: findings from synthetic trials with a known answer, the plotted data, report.md."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from altgrad.experiment import (
    RUN_DIR,
    STATE_DIR,
    SWEEP_FILE,
    TRIALS_DIR,
    TRIALS_FILE,
    TrialRecord,
    load_experiment,
)
from altgrad.report import cli, compute_findings, write_report
from altgrad.report.plots import plot_heatmap, plot_loss, plot_stability

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
    **signals: float,
) -> TrialRecord:
    """A trial whose val loss is `scale` × a fixed curve; from `nan_from` on the loss is NaN and
    the forward overflow rate ramps up before it. `signals` are extra constant metrics."""
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
            history.append(
                {**row, "val/loss": val, "val/step": step, "shadow/cos_mean": 0.99 - step / 1e4}
            )
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
SCALES = {  # (format, optimizer, precision) -> val-loss scale = the expected ratio to bf16
    ("e5m2", "adamw", "all"): 1.05,
    ("e4m3", "adamw", "all"): 1.03,
    ("e2m5", "adamw", "all"): 1.20,
    ("e5m2", "adamw", "mlp"): 1.02,
    ("e4m3", "adamw", "mlp"): 1.04,
    ("e2m5", "adamw", "mlp"): 1.10,
    ("e7m0", "adamw", "mlp"): 1.50,
    ("e5m2", "manifold", "all"): 1.04,
    ("e4m3", "manifold", "all"): 1.06,
    ("e2m5", "manifold", "all"): 1.08,
    ("e7m0", "manifold", "all"): 1.30,
    ("e5m2", "manifold", "mlp"): 1.03,
    ("e4m3", "manifold", "mlp"): 1.01,
    ("e2m5", "manifold", "mlp"): 1.09,
    ("e7m0", "manifold", "mlp"): 1.25,
}


def grid(**override: float) -> list[TrialRecord]:
    """bf16 per optimizer + SCALES + e7m0/all/adamw collapsing at step 37 (its loss before the
    collapse is the lowest of all: only its collapse keeps it from being the sweet spot)."""
    scales = {**SCALES, **{tuple(k.split("_")): v for k, v in override.items()}}
    return (
        [trial("bf16", opt) for opt in ("adamw", "manifold")]
        + [trial(f, o, p, s) for (f, o, p), s in scales.items()]
        + [trial("e7m0", "adamw", "all", 0.5, nan_from=37)]
    )


def test_sweet_spot_per_precision_and_optimizer():
    f = compute_findings(grid())
    spots = {
        (s.precision, s.optimizer): (s.winner.format, s.winner.ratio, s.runner_up.format)
        for s in f.sweet_spots
    }
    assert spots[("all", "adamw")][0::2] == ("e4m3", "e5m2")
    assert spots[("all", "adamw")][1] == pytest.approx(1.03)
    assert spots[("mlp", "adamw")][0] == "e5m2"
    assert spots[("all", "manifold")][0] == "e5m2"
    assert spots[("mlp", "manifold")][0] == "e4m3"
    head = f.headline("mlp")
    assert (head.winner.format, head.optimizer, head.winner.ratio) == (
        "e4m3",
        "manifold",
        pytest.approx(1.01),
    )
    excluded = next(
        s.excluded for s in f.sweet_spots if (s.precision, s.optimizer) == ("all", "adamw")
    )
    assert excluded == ("e7m0",)
    assert f.cells["e7m0", "adamw", "all"].ratio < 0.7  # lowest loss, yet not the sweet spot


def test_tie_goes_to_more_exponent_bits():
    f = compute_findings(grid(e2m5_adamw_all=1.03))
    spot = next(s for s in f.sweet_spots if (s.precision, s.optimizer) == ("all", "adamw"))
    assert (spot.winner.format, spot.runner_up.format) == ("e4m3", "e2m5")
    f = compute_findings(grid(e5m2_adamw_all=1.03))
    spot = next(s for s in f.sweet_spots if (s.precision, s.optimizer) == ("all", "adamw"))
    assert (spot.winner.format, spot.runner_up.format) == ("e5m2", "e4m3")


def test_cut_trials_compare_at_their_budget_and_do_not_win():
    """ASHA cut e4m3 at step 20: it is compared with bf16 up to step 20 (same curve: 1.0), and
    the full-length e5m2 is the sweet spot although its ratio is higher."""
    records = [trial("bf16"), trial("e4m3", steps=20, summary={"stop_reason": "asha"}), trial("e5m2", scale=1.05)]
    records[1].stop_reason = "asha"
    f = compute_findings(records)
    cut = f.cells["e4m3", "adamw", "all"]
    assert (cut.steps, cut.best, cut.baseline) == (20, curve(20, 1.0), curve(20, 1.0))
    assert f.cells["e5m2", "adamw", "all"].baseline == BF16_BEST
    (spot,) = f.sweet_spots
    assert (spot.winner.format, spot.runner_up.format) == ("e5m2", "e4m3")
    assert f.verdict.reason.endswith("vs bf16 3.1282, up to step 60")


def test_collapse_step_and_site_inferred_from_metrics():
    f = compute_findings(grid())
    (failure,) = f.failures
    assert (failure.trial.format, failure.trial.precision, failure.stop_reason) == (
        "e7m0",
        "all",
        "nan",
    )
    assert (failure.step, failure.collapsed, failure.where) == (37, True, "forward overflow")
    assert failure.evidence == "loss non-finite at step 37; quant/overflow_rate = 0.251 > 0.01"


@pytest.mark.parametrize(
    ("record", "where", "evidence"),
    [
        (
            trial(
                "e4m3",
                summary={"collapse_step": 12, "collapse_where": "optimizer", "stop_reason": "nan"},
            ),
            "optimizer stall",
            "recorded",
        ),
        (trial("e6m1", summary={"stop_reason": "bit_stall"}), "optimizer stall", "bit-stall"),
        (
            trial("e2m5", summary={"stop_reason": "asha"}, **{"quant/underflow_rate": 0.05}),
            "backward underflow",
            "quant/underflow_rate = 0.05 > 0.01",
        ),
        (
            trial(
                "e2m5",
                summary={"stop_reason": "asha"},
                **{"grad/dead_frac/h.0.mlp.c_fc": 0.9, "grad/dead_frac/lm_head": 0.7},
            ),
            "backward underflow",
            "grad/dead_frac = 0.8 > 0.5",
        ),
        (
            trial("e1m6", summary={"stop_reason": "error"}, **{"stability/grad_has_nan": 1.0}),
            "backward underflow",
            "gradient non-finite",
        ),
        (trial("e3m4", summary={"stop_reason": "asha"}), "—", "no signal"),
    ],
)
def test_failure_site(record, where, evidence):
    record.stop_reason = record.summary["stop_reason"]
    (failure,) = compute_findings([trial("bf16"), record]).failures
    assert failure.where == where
    assert evidence in failure.evidence


def test_manifold_delta_per_format():
    f = compute_findings(grid())
    deltas = {(d.standard.format, d.manifold.precision): d for d in f.deltas}
    assert set(deltas) == {
        (fmt, p) for fmt in ("e2m5", "e4m3", "e5m2", "e7m0") for p in ("all", "mlp")
    }
    d = deltas["e5m2", "all"]
    assert d.delta == pytest.approx((1.04 - 1.05) * BF16_BEST)
    assert d.relative == pytest.approx((1.04 - 1.05) / 1.05)
    only_adamw = [r for r in grid() if r.optimizer == "adamw"]
    assert compute_findings(only_adamw).deltas == []


@pytest.mark.parametrize(("scale", "passed"), [(1.05, True), (1.10, True), (1.2, False)])
def test_verdict(scale, passed):
    v = compute_findings(grid(e5m2_adamw_all=scale)).verdict
    assert v.passed is passed
    assert v.ratio == pytest.approx(scale)
    assert v.line.startswith(
        f"E5M2 within 10 % of BF16: {'PASS' if passed else 'INVESTIGATE'} (ratio {scale:.3f}"
    )


def test_verdict_fallbacks():
    records = [
        r for r in grid() if (r.format, r.precision, r.optimizer) != ("e5m2", "all", "adamw")
    ]
    v = compute_findings(records).verdict
    assert (v.cell.precision, v.cell.optimizer, v.passed) == ("all", "manifold", True)
    no_e5m2 = compute_findings([r for r in grid() if r.format != "e5m2"]).verdict
    assert not no_e5m2.passed and "no e5m2" in no_e5m2.line
    no_bf16 = compute_findings([r for r in grid() if r.format != "bf16"]).verdict
    assert not no_bf16.passed and "no bf16" in no_bf16.line
    broke = grid()
    broke.append(trial("e5m2", "adamw", "all", 1.0, seed=1, nan_from=50))
    v = compute_findings(broke).verdict
    assert not v.passed and "stopped: nan" in v.reason


def test_seeds_are_averaged():
    records = [
        trial("bf16"),
        trial("bf16", seed=1),
        trial("e4m3", scale=1.0),
        trial("e4m3", scale=1.1, seed=1),
    ]
    cell = compute_findings(records).cells["e4m3", "adamw", "all"]
    assert cell.best == pytest.approx(1.05 * BF16_BEST)
    assert cell.ratio == pytest.approx(1.05)


def test_missing_optimizer_baseline_is_borrowed_and_noted():
    records = [trial("bf16"), trial("e4m3", "manifold", scale=1.2)]
    f = compute_findings(records)
    assert f.cells["e4m3", "manifold", "all"].ratio == pytest.approx(1.2)
    assert any("`manifold` has no bf16 trial" in n for n in f.notes)
    assert "bf16/manifold: no baseline trial" in f.missing



def test_power_of_two_twins_are_reported_as_one_result(tmp_path):
    """e0m7 and e1m6 train identically under amax scaling: report.md must not count them twice."""
    same = [trial("bf16"), trial("e0m7", scale=1.1), trial("e1m6", scale=1.1), trial("e4m3", scale=1.2)]
    twins = compute_findings(same).twins
    assert [(t.smaller, t.larger, t.shift, t.identical, t.shared) for t in twins] == [("e0m7", "e1m6", 1, 1, 1)]
    text = write_report(same, tmp_path / "same").read_text()
    assert "**Not independent:** e0m7 and e1m6 are one grid up to a factor 2^1" in text
    assert "identical in all 1 shared cells" in text

    apart = [*same[:2], trial("e1m6", scale=1.15), same[3]]  # e.g. `scaling.mode: none`
    assert "differ in 1 of 1 shared cells" in compute_findings(apart).twins[0].note()
    assert compute_findings([same[0], same[1], same[3]]).twins == []

def test_loss_plot_data_match_input(tmp_path):
    records = grid()
    f = compute_findings(records)
    plot = plot_loss(records, f, "adamw", tmp_path / "loss.png")
    assert {panel for panel, _ in plot.lines} == {"precision: all", "precision: mlp"}
    for r in records:
        if r.optimizer != "adamw":
            continue
        steps, values = r.val_series()
        for panel in (
            ["precision: all", "precision: mlp"]
            if r.format == "bf16"
            else [f"precision: {r.precision}"]
        ):
            x, y = plot.lines[panel, r.format]
            np.testing.assert_array_equal(x, steps)
            np.testing.assert_array_equal(y, np.where(np.isfinite(values), values, np.nan))
    assert np.isnan(plot.lines["precision: all", "e7m0"][1][-1])  # a gap, not a value
    assert plot.collapses == {"precision: all": [37.0]}
    assert plot.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stability_and_heatmap_data_match_input(tmp_path):
    records = grid()
    f = compute_findings(records)
    plot = plot_stability(records, f, "manifold", tmp_path / "stability.png")
    r = next(
        r for r in records if (r.format, r.optimizer, r.precision) == ("e7m0", "manifold", "mlp")
    )
    for metric in ("quant/bit_stall_rate", "quant/overflow_rate", "shadow/cos_mean"):
        x, y = plot.lines[f"mlp: {metric}", "e7m0"]
        np.testing.assert_array_equal(x, r.series(metric)[0])
        np.testing.assert_array_equal(y, r.series(metric)[1])
    assert not any(label == "bf16" for _, label in plot.lines)

    heat = plot_heatmap(f, "adamw", tmp_path / "heat.png")
    assert f.formats == ("e2m5", "e4m3", "e5m2", "e7m0")
    expected = [
        [SCALES.get((fmt, "adamw", p), np.nan) for p in ("all", "mlp")] for fmt in f.formats
    ]
    np.testing.assert_allclose(heat.images["Best val loss / bf16 — optimizer adamw"], expected)
    sparse = compute_findings(
        [r for r in records if r.format not in ("e2m5",) or r.precision != "mlp"]
    )
    image = plot_heatmap(sparse, "adamw", tmp_path / "sparse.png").images[
        "Best val loss / bf16 — optimizer adamw"
    ]
    assert np.isnan(image[0, 1]) and np.isfinite(image[0, 0])


def test_single_value_axes(tmp_path):
    records = [trial("bf16", prec="mlp"), trial("e5m2", prec="mlp", scale=1.2)]
    path = write_report(records, tmp_path)
    text = path.read_text()
    assert "INVESTIGATE (ratio 1.200" in text and "e5m2 / mlp / adamw" in text
    assert "n/a: needs both `adamw` and `manifold`" in text
    assert "- Sweet spot for **mlp** quantization: e5m2 at 1.200× bf16 (adamw)" in text
    assert (tmp_path / "heatmap_adamw.png").stat().st_size > 0


def test_partial_experiment_lists_what_is_missing():
    records = [
        trial("bf16"),
        trial("e4m3", prec="all"),
        trial("e5m2", prec="all", status="RUNNING", steps=20),
        trial("e4m3", prec="mlp", status="PENDING", steps=0),
        trial("e2m5", prec="mlp"),
    ]
    missing = compute_findings(records, missing=["e2m5/adamw/all: never started", "e4m3_adamw_mlp_0"]).missing
    assert missing == [
        "e2m5/adamw/all: never started",
        "e4m3_adamw_mlp_0",  # the caller named it: not repeated as "not started"
        "e5m2_adamw_all_0 (e5m2 / adamw / all): still running at step 20, numbers provisional",
        "e2m5/adamw/all: no trial",
        "e5m2/adamw/mlp: no trial",
    ]
    assert "e4m3_adamw_mlp_0 (e4m3 / adamw / mlp): not started" in compute_findings(records).missing


def test_only_baseline_trials(tmp_path):
    text = write_report([trial("bf16")], tmp_path).read_text()
    assert "INVESTIGATE" in text and "no e5m2 trial" in text
    assert (tmp_path / "loss_adamw.png").stat().st_size > 0


def run_dir(root, r: TrialRecord):
    return root / TRIALS_DIR / r.trial_id / RUN_DIR


def write_state(root, records: list[TrialRecord]):
    """The sweep's state files that `load_experiment` reads (see altgrad/experiment.py): one grid
    point per record, keyed by its trial id, whose run directory is `run_dir(root, record)`."""
    points = [{"key": r.trial_id, "format": r.format, "optimizer": r.optimizer,
               "precision": r.precision, "seed": r.seed, "params": {}} for r in records]
    trials = {r.trial_id: {**point, "dir": r.trial_id, "status": r.status, "failures": 0, "error": None}
              for r, point in zip(records, points, strict=True) if r.status != "PENDING"}
    (root / STATE_DIR).mkdir(parents=True)
    (root / STATE_DIR / SWEEP_FILE).write_text(json.dumps({"points": points}))
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
    return write_state(root, records)


def main(argv: list[str]) -> int:
    """`python -m altgrad report ...` without importing the other sub-commands (torch)."""
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_writes_the_report(tmp_path, capsys):
    exp = write_experiment(tmp_path / "exp", grid())
    assert main(["report", str(exp), "--out", str(tmp_path / "out")]) == 0
    assert "report written" in capsys.readouterr().out
    path = tmp_path / "out" / "report.md"
    text = path.read_text()
    assert text.startswith("# AltGrad report: exp")
    assert "**E5M2 within 10 % of BF16: PASS (ratio 1.050" in text
    assert "- Sweet spot for **mlp** quantization: e4m3 at 1.010× bf16 (manifold)" in text
    assert "| e7m0_adamw_all_0 | e7m0 | adamw | all | 0 | nan | 37 (collapse) | forward overflow |" in text
    assert "Nothing: every grid point has a finished trial." in text
    pngs = sorted(p.name for p in path.parent.glob("*.png"))
    assert pngs == sorted(f"{kind}_{opt}.png" for kind in ("loss", "heatmap", "stability")
                          for opt in ("adamw", "manifold"))
    assert all((path.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in pngs)
    assert all((path.parent / name).stat().st_size > 5000 for name in pngs)
    assert all(f"]({name})" in text for name in pngs)
    assert text.index("## Plots") < text.index("## Sweet spot per layer precision") < text.index("## Failures and early stops")


def test_cli_partial_experiment_says_what_is_missing(tmp_path):
    records = [r for r in grid() if r.optimizer == "adamw" and r.precision == "all"]
    records[2] = trial(records[2].format, records[2].optimizer, records[2].precision, status="PENDING", steps=0)
    records[3] = trial(records[3].format, records[3].optimizer, records[3].precision, status="RUNNING", steps=20)
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
    exp = write_experiment(tmp_path / "exp", grid())
    metrics = run_dir(exp, trial("e4m3")) / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([*lines[:5], "{not json", *lines[5:]]) + "\n")
    assert main(["report", str(exp)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl: line 6 is not valid JSON" in err


def test_cli_corrupt_trial_never_hides_the_others(tmp_path, capsys):
    exp = write_experiment(tmp_path / "exp", grid())
    (run_dir(exp, trial("e4m3")) / "summary.json").write_text("{not json")
    assert main(["report", str(exp)]) == 2
    assert "e4m3_adamw_all_0" in capsys.readouterr().err
    text = (exp / "report" / "report.md").read_text()
    assert "e5m2_adamw_all_0" in text and "e4m3_adamw_all_0" in text.split("## What is missing")[1]


@pytest.mark.slow
@pytest.mark.ray
def test_tiny_sweep_writes_the_report(ray_address, eurlex_dir, data_root, tmp_path):
    """A real sweep (Ray, ASHA, the stability stopper; e7m0 at a learning rate it cannot take) ends
    with the report; its verdict, failure row and plotted curves match the trial data."""
    from altgrad.tune.ablation import FormatAblation
    from altgrad.tune.cli import sweep_main

    sets = [
        "preset=cpu", "grid.formats=[bf16, e5m2, e7m0]", "grid.optimizers=[adamw]", "grid.precisions=[all]",
        "grid.format_overrides={e7m0: {optim: {lr: 1000}}}",
        f"base.data.source=jsonl:{eurlex_dir}", f"base.data.data_root={data_root}", "base.data.max_docs=40",
        "base.model={n_layer: 1, n_head: 2, n_embd: 32, block_size: 16}", "base.train.batch_size=2",
        "base.train.max_steps=20", "base.train.warmup_steps=2", "base.train.eval_interval=5",
        "base.train.eval_iters=2", "asha.grace_period=10", "stopper.nan_patience=3",
        "wandb.enabled=false", "dashboard.enabled=false",
    ]
    config = Path(__file__).resolve().parents[1] / "sweeps" / "configs" / "format_ablation.yaml"
    argv = [a for s in sets for a in ("--set", s)] + ["--name", "tiny", "--storage-path", str(tmp_path)]
    assert sweep_main(FormatAblation, config, "test", argv) == 0
    exp = tmp_path / "tiny"
    text = (exp / "report" / "report.md").read_text()
    assert all((exp / "report" / f"{kind}_adamw.png").stat().st_size > 5000 for kind in ("loss", "heatmap", "stability"))

    records = {r.format: r for r in load_experiment(exp)}
    e5m2_steps, e5m2_vals = records["e5m2"].val_series()
    bf16_vals = [v for s, v in zip(*records["bf16"].val_series(), strict=True) if s <= e5m2_steps[-1]]
    ratio = min(filter(math.isfinite, e5m2_vals)) / min(filter(math.isfinite, bf16_vals))
    assert f"**E5M2 within 10 % of BF16: {'PASS' if ratio <= 1.1 else 'INVESTIGATE'} (ratio {ratio:.3f};" in text
    e7m0 = records["e7m0"]  # stopped by the stopper, maybe before the trainer wrote a summary
    first_nan = next(s for s, v in zip(*e7m0.series("train/loss"), strict=True) if not math.isfinite(v))
    step = e7m0.summary.get("collapse_step") or first_nan
    assert (e7m0.stop_reason, e7m0.summary.get("collapse_where", "forward")) == ("nan", "forward")
    assert f"| e7m0-adamw-all-s42 | e7m0 | adamw | all | 42 | nan | {step} (collapse) | forward overflow |" in text

    loaded = list(records.values())
    plot = plot_loss(loaded, compute_findings(loaded), "adamw", tmp_path / "loss.png")
    for r in loaded:
        steps, values = r.val_series()
        np.testing.assert_array_equal(plot.lines["precision: all", r.format][0], steps)
        np.testing.assert_array_equal(plot.lines["precision: all", r.format][1],
                                      np.where(np.isfinite(values), values, np.nan))
    assert main(["report", str(exp), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.md").read_text().split("\n", 1)[1] == text.split("\n", 1)[1]
