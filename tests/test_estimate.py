"""`--dry-run`'s time and cost estimate (`altgrad.tune.estimate`): its arithmetic with known step
costs, and a step cost measured here."""

from __future__ import annotations

import pytest
from sweep_helpers import dry_run


def test_dry_run_estimate_arithmetic(monkeypatch, capsys):
    """Wall time = sum over trials of (overhead + start-up + steps x step + evals x eval) / trials
    at a time; GPU-hours = trial time x GPU per trial; with known per-step costs."""
    from altgrad.tune import estimate

    costs = {"bf16": estimate.StepCost(0.1, 1.0, 5.0, "measured"),
             "e4m3": estimate.StepCost(0.2, 2.0, 7.0, "measured")}
    monkeypatch.setattr(estimate, "measure", lambda run, steps, threads: costs[
        "bf16" if run.quant.format == "bf16" else "e4m3"])
    out = dry_run(capsys, "--smoke", "--set", "estimate.measure_steps=6", "--set", "estimate.trial_overhead_s=3",
                  "--set", "preset=cpu", "--set", "grid.formats=[bf16, e4m3, e5m2]")
    # smoke: 20 steps, evaluated at steps 1, 5, 10, 15 and 20 (the last is an eval_interval step
    # too: counted once); 2 trials at a time on 2 cores
    bf16 = 3 + 5 + 20 * 0.1 + 5 * 1.0
    quantized = 3 + 7 + 20 * 0.2 + 5 * 2.0
    assert f"estimated wall time: {(bf16 + 2 * quantized) / 2:.0f} s for 3 trials" in out
    assert "measured here over 6 steps (bf16 100 ms/step, eval 1.00 s" in out

    gpu = dry_run(capsys, "--smoke", "--set", "preset=gpu", "--set", "estimate.step_time_s.gpu=0.05",
                  "--set", "estimate.usd_per_gpu_hour=4", "--set", "estimate.trial_overhead_s=10",
                  "--set", "estimate.compile_s={}")
    step = 0.05  # stored: an eval batch is a third of a step; gpu smoke evaluates 20 batches
    trial = 10 + 20 * step + 5 * 20 * step / 3
    hours = 3 * trial * 0.25 / 3600
    assert f"GPU time: {hours:.2f} GPU-hours (0.25 GPU per trial) = ${hours * 4:.2f} at $4/GPU-hour" in gpu
    assert "3 step graphs" in gpu and "not counted (no estimate.compile_s.gpu)" in gpu

    # two seeds: twice the trials, the same three step graphs (one per format), each compiled once
    seeds = dry_run(capsys, "--smoke", "--set", "preset=gpu", "--set", "estimate.step_time_s.gpu=0.05",
                    "--set", "estimate.usd_per_gpu_hour=4", "--set", "estimate.trial_overhead_s=10",
                    "--set", "estimate.compile_s.gpu=30", "--set", "grid.seeds=[1, 2]")
    hours = (6 * trial + 3 * 30) * 0.25 / 3600
    assert f"GPU time: {hours:.2f} GPU-hours (0.25 GPU per trial) = ${hours * 4:.2f} at $4/GPU-hour" in seeds
    assert "3 step graphs compiled once each at 30 s" in seeds
    # diagnostics on every other step: each format's trial compiles a graph with them and one without
    sparse = dry_run(capsys, "--smoke", "--set", "preset=gpu", "--set", "estimate.step_time_s.gpu=0.05",
                     "--set", "estimate.compile_s.gpu=30", "--set", "base.train.diag_every=2")
    assert "6 step graphs compiled once each at 30 s" in sparse


@pytest.mark.usefixtures("eager_kernels")  # the compiled kernels are tested elsewhere
def test_measured_step_cost_is_timed_here(make_config):
    from altgrad.tune.estimate import measure

    cost = measure(make_config("quant.format=e4m3", "train.max_steps=30"), steps=6, threads=1)
    assert cost.source == "measured" and 0 < cost.step_s < 5 and cost.eval_s >= 0 and cost.startup_s > 0
