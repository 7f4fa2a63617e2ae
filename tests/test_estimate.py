"""`--dry-run`'s time and cost estimate (`altgrad.tune.estimate`): its arithmetic with known step
costs, and a step cost measured here."""

from __future__ import annotations

import pytest
from sweep_helpers import ablation, dry_run


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


def test_measured_compiling_is_charged_once_per_step_graph(monkeypatch, capsys):
    """Measured: each trial pays its warm start-up; each distinct step graph its compiling once,
    at the compile time measured for its kind of run, however many trials (seeds) share it."""
    from altgrad.tune import estimate

    costs = {"bf16": estimate.StepCost(0.1, 1.0, 2.0, "measured", compile_s=4.0),
             "e4m3": estimate.StepCost(0.2, 2.0, 3.0, "measured", compile_s=7.0)}
    monkeypatch.setattr(estimate, "measure", lambda run, steps, threads: costs[
        "bf16" if run.quant.format == "bf16" else "e4m3"])
    out = dry_run(capsys, "--smoke", "--set", "estimate.measure_steps=6", "--set", "estimate.trial_overhead_s=3",
                  "--set", "preset=cpu", "--set", "base.train.compile=true", "--set", "grid.formats=[bf16, e4m3, e5m2]",
                  "--set", "grid.seeds=[1, 2]")
    bf16 = 3 + 2 + 20 * 0.1 + 5 * 1.0
    quantized = 3 + 3 + 20 * 0.2 + 5 * 2.0
    # per format a graph with diagnostics and one without (diag_every: 2), each once for both seeds
    graphs = 2 * 4 + 2 * 2 * 7
    assert f"estimated wall time: {(2 * bf16 + 4 * quantized + graphs) / 2:.0f} s for 6 trials" in out
    assert "quantized 200 ms/step, eval 2.00 s, start-up 3.0 s, compiling 7.0 s per step graph" in out
    assert f"; 6 step graphs compiled once each, {graphs} s in all" in out


def test_measured_step_cost_is_timed_here(make_config, monkeypatch):
    """Timed in a child process, as a trial runs: eager, nothing to compile; compiled, a warm
    start-up and the compiling measured apart -- from a cache of the measurement's own, so a
    second measurement compiles again (it does not find the first one's graphs) -- at any
    log_interval."""
    from altgrad.tune.estimate import measure

    monkeypatch.setenv("ALTGRAD_NO_COMPILE", "1")
    eager = measure(make_config("quant.format=e4m3", "train.max_steps=30", "train.log_interval=5"), steps=6, threads=1)
    assert eager.source == "measured" and 0 < eager.step_s < 5 and eager.eval_s >= 0 and eager.startup_s > 0
    assert eager.compile_s == 0

    monkeypatch.delenv("ALTGRAD_NO_COMPILE")
    # diagnostics on steps 1, 2, 4, 6: step 3 compiles the graph without them (~15 s cold), which is
    # not a step's time
    tiny = make_config("quant.format=bf16", "train.compile=true", "model.n_layer=1", "model.n_head=1",
                       "model.n_embd=16", "train.log_interval=5", "train.diag_every=2")
    first, second = (measure(tiny, steps=6, threads=1) for _ in range(2))
    for cost in (first, second):  # compiling a step graph here takes seconds; loading it, less
        assert 0 < cost.startup_s < cost.compile_s and 0 < cost.step_s < 0.2
    assert second.compile_s > first.compile_s / 3  # cold again, not a hit in the first one's cache


def test_measured_dry_run_without_its_data_says_so(capsys, tmp_path):
    """A measured estimate trains on the data: where there is none, a clear error and exit 2."""
    code = ablation("--dry-run", "--smoke", "--set", "preset=cpu", "--set", "estimate.measure_steps=6",
                    "--set", f"base.data.source=jsonl:{tmp_path / 'missing'}", "--storage-path", str(tmp_path))
    assert code == 2 and "missing does not exist" in capsys.readouterr().err


def test_a_steady_step_leaves_out_the_first_two_of_each_kind(make_config):
    """Diagnostics on steps 1, 2, 4, 6, 8: the first two steps of each kind (1, 2; 3, 5) compile,
    load or record their graphs and count as start-up; the rest are the step time; the last step's
    excess is its evaluation."""
    from altgrad.tune.estimate import timing

    train = make_config("train.diag_every=2", "train.max_steps=8").train
    durations = [30.0, 2.0, 9.0, 0.1, 1.0, 0.3, 0.2, 0.5]  # steps 1-8: the slow ones compile
    ends = [sum(durations[:i + 1]) for i in range(len(durations))]
    t = timing(ends, train)
    assert t.step_s == pytest.approx((0.1 + 0.3 + 0.2) / 3)  # steps 4, 6 (diagnostics) and 7
    assert t.eval_s == pytest.approx(0.5 - t.step_s)
    assert t.startup_s == pytest.approx(sum(durations[:-1]) - 7 * t.step_s)
