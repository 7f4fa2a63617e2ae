"""`--dry-run`'s time and cost estimate (`altgrad.tune.estimate`): its arithmetic with known step
costs, and a step cost measured here."""

from __future__ import annotations

import pytest
from sweep_helpers import ablation, dry_run

from altgrad.tune.timed_run import Timing


@pytest.fixture(autouse=True)
def compiling_on(monkeypatch):
    """Whether the grid compiles is part of what is estimated: not left to the environment."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)


def test_dry_run_estimate_arithmetic(monkeypatch, capsys):
    """Wall time = the sweep's overhead + sum over trials of (overhead + start-up + each step at its
    kind's cost + evals x eval + shadow comparisons x shadow + checkpoints x checkpoint) / trials at
    a time; GPU-hours = trial time x GPU per trial; with known per-step costs."""
    from altgrad.tune import estimate

    costs = {"bf16": estimate.StepCost(Timing({False: 0.1, True: 0.3}, shadow_s=0.05, eval_s=1.0, checkpoint_s=0.5,
                                              startup_s=5.0), "measured"),
             "e4m3": estimate.StepCost(Timing({False: 0.2, True: 0.4}, shadow_s=0.08, eval_s=2.0, checkpoint_s=0.25,
                                              startup_s=7.0), "measured")}
    monkeypatch.setattr(estimate, "measure", lambda run, steps, cpus, cache, gpu_fraction: costs[
        "bf16" if run.quant.format == "bf16" else "e4m3"])
    out = dry_run(capsys, "--smoke", "--set", "estimate.measure_steps=6", "--set", "estimate.trial_overhead_s=3",
                  "--set", "estimate.sweep_overhead_s=8", "--set", "preset=cpu", "--set", "grid.formats=[bf16, e4m3, e5m2]")
    # smoke: 20 steps, diagnostics on step 1 and every 2nd (11 of them), evaluated at steps 1, 5,
    # 10, 15 and 20 (the last is an eval_interval step too: counted once), compared with the shadow
    # at steps 1, 10 and 20 (shadow_every 10), checkpointed at 10 and 20; 2 trials at a time on 2
    # cores
    bf16 = 3 + 5 + 11 * 0.3 + 9 * 0.1 + 5 * 1.0 + 3 * 0.05 + 2 * 0.5
    quantized = 3 + 7 + 11 * 0.4 + 9 * 0.2 + 5 * 2.0 + 3 * 0.08 + 2 * 0.25
    assert f"estimated wall time: {8 + (bf16 + 2 * quantized) / 2:.0f} s for 3 trials" in out
    assert ("measured here, a short run of each (bf16 100 ms/step (300 with diagnostics), eval 1.00 s, "
            "checkpoint 0.50 s") in out

    gpu = dry_run(capsys, "--smoke", "--set", "preset=gpu", "--set", "estimate.step_time_s.gpu=0.05",
                  "--set", "estimate.usd_per_gpu_hour=4", "--set", "estimate.trial_overhead_s=10",
                  "--set", "estimate.startup_s.gpu.step_graph=30", "--set", "estimate.compile_s={}",
                  "--set", "estimate.sweep_overhead_s=0")
    step = 0.05  # stored: an eval batch is a third of a step; gpu smoke evaluates 20 batches
    trial = 10 + 30 + 20 * step + 5 * 20 * step / 3  # overhead, start-up, steps, evaluations
    assert f"estimated wall time: {trial:.0f} s for 3 trials at full budget, 3 at a time" in gpu
    hours = 3 * trial * 0.25 / 3600
    assert f"GPU time: {hours:.2f} GPU-hours (0.25 GPU per trial) = ${hours * 4:.2f} at $4/GPU-hour" in gpu
    assert "; start-up: 30 s a trial (estimate.startup_s.gpu.step_graph)" in gpu
    assert "; compiling its 3 step graphs not counted (no estimate.compile_s.gpu.step_graph)" in gpu
    unknown = dry_run(capsys, "--smoke", "--set", "preset=gpu", "--set", "estimate.step_time_s.gpu=0.05",
                      "--set", "estimate.startup_s={}")
    assert "; start-up not counted (no estimate.startup_s.gpu.step_graph)" in unknown
    no_step = dry_run(capsys, "--smoke", "--set", "preset=gpu", "--set", "estimate.step_time_s={}")
    assert "time estimate: n/a (preset gpu cannot run here and the config has no estimate.step_time_s.gpu)" in no_step
    assert "estimated wall time" not in no_step

    # two seeds: twice the trials, the same three step graphs (one per format), each compiled once
    seeds = dry_run(capsys, "--smoke", "--set", "preset=gpu", "--set", "estimate.step_time_s.gpu=0.05",
                    "--set", "estimate.usd_per_gpu_hour=4", "--set", "estimate.trial_overhead_s=10",
                    "--set", "estimate.startup_s.gpu.step_graph=30", "--set", "estimate.compile_s.gpu.step_graph=30",
                    "--set", "estimate.sweep_overhead_s=0", "--set", "grid.seeds=[1, 2]")
    assert f"estimated wall time: {(6 * trial + 3 * 30) / 4:.0f} s for 6 trials at full budget, 4 at a time" in seeds
    hours = (6 * trial + 3 * 30) * 0.25 / 3600
    assert f"GPU time: {hours:.2f} GPU-hours (0.25 GPU per trial) = ${hours * 4:.2f} at $4/GPU-hour" in seeds
    assert "; compiling its 3 step graphs: 30 s each, once (estimate.compile_s.gpu.step_graph)" in seeds
    # diagnostics on every other step: each format's trial compiles a graph with them and one without
    sparse = dry_run(capsys, "--smoke", "--set", "preset=gpu", "--set", "estimate.step_time_s.gpu=0.05",
                     "--set", "estimate.compile_s.gpu.step_graph=30", "--set", "base.train.diag_every=2")
    assert "; compiling its 6 step graphs: 30 s each, once" in sparse


def test_stored_costs_are_charged_by_kind_of_compiled_unit(capsys):
    """Stored: a trial's start-up and each unit's compiling are stored per kind of compiled unit, a
    step graph (`train.compile` on) or a set of per-tensor kernels (off: they start and compile
    faster); a kind with nothing stored for the preset is not counted, and the estimate says which.
    (One value per preset charged the gpu preset's kernel sets a step graph's 55 s and 180 s.)"""
    common = ["--smoke", "--set", "preset=gpu", "--set", "estimate.step_time_s.gpu=0.05",
              "--set", "estimate.trial_overhead_s=10", "--set", "estimate.sweep_overhead_s=0",
              "--set", "estimate.startup_s.gpu.step_graph=30", "--set", "estimate.compile_s.gpu.step_graph=20"]
    work = 10 + 20 * 0.05 + 5 * 20 * 0.05 / 3  # overhead, steps, evaluations: a trial less its start-up
    # bf16, e4m3 and e5m2: two kernel sets (e4m3 and e5m2 are one kernel family), three step graphs
    kernels = dry_run(capsys, *common, "--set", "base.train.compile=false", "--set", "estimate.startup_s.gpu.kernel_set=5",
                      "--set", "estimate.compile_s.gpu.kernel_set=8")
    assert f"estimated wall time: {(3 * (work + 5) + 2 * 8) / 3:.0f} s for 3 trials" in kernels
    assert ("; start-up: 5 s a trial (estimate.startup_s.gpu.kernel_set); compiling its 2 kernel sets: 8 s each, "
            "once (estimate.compile_s.gpu.kernel_set)") in kernels
    assert "step graph" not in kernels
    unknown = dry_run(capsys, *common, "--set", "base.train.compile=false")
    assert f"estimated wall time: {work:.0f} s for 3 trials" in unknown
    assert ("; start-up not counted (no estimate.startup_s.gpu.kernel_set); compiling its 2 kernel sets not "
            "counted (no estimate.compile_s.gpu.kernel_set)") in unknown
    both = dry_run(capsys, *common, "--set", "estimate.startup_s.gpu.kernel_set=5",
                   "--set", "estimate.compile_s.gpu.kernel_set=8", "--set", "grid.axes={train.compile: [true, false]}")
    assert f"estimated wall time: {(3 * (work + 30) + 3 * (work + 5) + 3 * 20 + 2 * 8) / 4:.0f} s for 6 trials" in both
    assert ("; start-up (step graphs): 30 s a trial (estimate.startup_s.gpu.step_graph); start-up (kernel sets): "
            "5 s a trial (estimate.startup_s.gpu.kernel_set); compiling its 3 step graphs: 20 s each, once "
            "(estimate.compile_s.gpu.step_graph); compiling its 2 kernel sets: 8 s each, once "
            "(estimate.compile_s.gpu.kernel_set)") in both


def test_measured_compiling_is_charged_once_per_compiled_unit(monkeypatch, capsys):
    """Measured: each trial pays its warm start-up; each distinct step graph (or with
    `train.compile` off, each set of per-tensor kernels: one per kernel family of formats, e4m3 and
    e5m2 one, e7m0 another) its compiling once, at the compile time measured for its kind of run,
    however many trials (seeds) share it; nothing where compiling is off."""
    from altgrad.tune import estimate

    costs = {"bf16": estimate.StepCost(Timing({False: 0.1, True: 0.1}, 0.0, 1.0, 0.0, 2.0), "measured", 4.0),
             "e4m3": estimate.StepCost(Timing({False: 0.2, True: 0.2}, 0.0, 2.0, 0.0, 3.0), "measured", 7.0)}
    monkeypatch.setattr(estimate, "measure", lambda run, steps, cpus, cache, gpu_fraction: costs[
        "bf16" if run.quant.format == "bf16" else "e4m3"])
    out = dry_run(capsys, "--smoke", "--set", "estimate.measure_steps=6", "--set", "estimate.trial_overhead_s=3",
                  "--set", "preset=cpu", "--set", "base.train.compile=true", "--set", "grid.formats=[bf16, e4m3, e5m2]",
                  "--set", "grid.seeds=[1, 2]", "--set", "estimate.sweep_overhead_s=0")
    bf16 = 3 + 2 + 20 * 0.1 + 5 * 1.0
    quantized = 3 + 3 + 20 * 0.2 + 5 * 2.0
    # per format a graph with diagnostics and one without (diag_every: 2), each once for both seeds
    graphs = 2 * 4 + 2 * 2 * 7
    assert f"estimated wall time: {(2 * bf16 + 4 * quantized + graphs) / 2:.0f} s for 6 trials" in out
    assert ("quantized 200 ms/step (200 with diagnostics), eval 2.00 s, checkpoint 0.00 s, start-up 3.0 s, "
            "compiling 7.0 s per unit") in out
    assert f"; 6 step graphs compiled once each, {graphs} s in all" in out

    per_tensor = ["--smoke", "--set", "estimate.measure_steps=6", "--set", "estimate.trial_overhead_s=3",
                  "--set", "preset=cpu", "--set", "base.train.compile=false", "--set", "estimate.sweep_overhead_s=0",
                  "--set", "grid.formats=[bf16, e4m3, e5m2, e7m0]", "--set", "grid.seeds=[1, 2]"]
    kernels = dry_run(capsys, *per_tensor)
    assert f"estimated wall time: {(2 * bf16 + 6 * quantized + 4 + 2 * 7) / 2:.0f} s for 8 trials" in kernels
    assert f"; 3 kernel sets compiled once each, {4 + 2 * 7} s in all" in kernels
    monkeypatch.setenv("ALTGRAD_NO_COMPILE", "1")
    eager = dry_run(capsys, *per_tensor)
    assert f"estimated wall time: {(2 * bf16 + 6 * quantized) / 2:.0f} s for 8 trials" in eager
    assert "compiled once" not in eager


def test_measured_step_cost_is_timed_here(make_config, monkeypatch, tmp_path):
    """Timed in a child process, as a trial runs: a run that does not compile, once, with nothing
    to compile, each kind of step (with and without diagnostics) timed apart; a compiled one twice,
    its warm start-up and its compiling measured apart -- in the cache it is given, where the second
    run finds what the first compiled (else the two start-ups would differ by no compile) -- at any
    log_interval. (The run that does not compile starts up in ~0.4 s, less than the noise of the
    2-3 s evaluation its start-up is told apart from: on a loaded machine it measured 0, so only the
    compiled run's start-up is checked. The compiled one has one kind of step, one graph to compile:
    a cold compile costs ~15 s here.)"""
    from altgrad.tune.estimate import measure

    with monkeypatch.context() as eager_kernels:
        eager_kernels.setenv("ALTGRAD_NO_COMPILE", "1")  # the child inherits it
        # diagnostics every other step in the timed run; enough evaluation batches that an
        # evaluation stands out of a step's noise, which a loaded machine's steps otherwise can
        # exceed (eval_s then clamps to 0)
        eager = measure(make_config("quant.format=e4m3", "train.max_steps=30", "train.log_interval=5",
                                    "train.diag_every=4", "train.eval_iters=24"), steps=6, cpus=1,
                        cache=tmp_path / "eager")
    assert eager.source == "measured" and eager.timing.eval_s > 0
    steps = eager.timing.step_s
    assert set(steps) == {True, False} and all(0 < step < 5 for step in steps.values())
    assert eager.compile_s == 0

    tiny = make_config("quant.format=bf16", "train.compile=true", "model.n_layer=1", "model.n_head=1",
                       "model.n_embd=16", "train.log_interval=5", "train.diag_every=0", "train.eval_iters=24")
    first = measure(tiny, steps=6, cpus=1, cache=tmp_path / "one")
    # compiling a step graph here takes seconds; loading it, less
    assert 0 < first.timing.startup_s < first.compile_s and first.timing.eval_s > 0
    assert set(first.timing.step_s) == {False} and 0 < first.timing.step_s[False] < 0.2
    assert any(f.is_file() for f in (tmp_path / "one").rglob("*"))  # compiled into the cache it was given


def test_measured_cost_charges_each_trial_its_kinds_of_step_and_splits_the_compiling(make_config, monkeypatch,
                                                                                     tmp_path):
    """The warm run's steady steps, with and without diagnostics, are charged to each trial for the
    steps it has of each kind (a kind not timed costs what the other does), and its shadow
    comparison for each step that compares (on every step, every step); the cold run's longer
    start-up is the compiling of its step graphs, split evenly (or of its per-tensor kernels)."""
    from altgrad.tune import estimate

    warm = Timing({True: 0.32, False: 0.12}, 0.04, 1.5, 2.5, startup_s=10.0)
    timings = iter([Timing({True: 0.3, False: 0.1}, 0.02, 1.0, 2.0, startup_s=50.0), warm])  # cold, warm
    monkeypatch.setattr(estimate, "timed_run", lambda run, workdir, cache, cpus, gpu_fraction: next(timings))
    cost = estimate.measure(make_config("train.compile=true", "train.diag_every=4", "train.max_steps=20"),
                            steps=6, cpus=1, cache=tmp_path)
    assert cost.compile_s == pytest.approx((50.0 - 10.0) / 2)  # two graphs: with and without diagnostics
    assert cost.timing == warm
    timings = iter([Timing({True: 0.3, False: 0.1}, 0.02, 1.0, 2.0, startup_s=40.0), warm])
    kernels = estimate.measure(make_config("train.compile=false", "train.diag_every=4", "train.max_steps=20"),
                               steps=6, cpus=1, cache=tmp_path)
    assert kernels.compile_s == pytest.approx(40.0 - 10.0) and kernels.timing == warm  # one set of kernels

    def trial(diag_every: int, shadow_every: int = 0, timed: estimate.StepCost = cost) -> float:
        return timed.trial_s(make_config(f"train.diag_every={diag_every}", f"train.shadow_every={shadow_every}",
                                         "train.max_steps=20"), overhead_s=0)

    assert trial(4) - trial(0) == pytest.approx(6 * (0.32 - 0.12))  # steps 1, 4, 8, 12, 16, 20
    assert trial(1) - trial(0) == pytest.approx(20 * (0.32 - 0.12))
    assert trial(0, shadow_every=10) - trial(0) == pytest.approx(3 * 0.04)  # steps 1, 10, 20
    assert trial(0, shadow_every=1) - trial(0) == pytest.approx(20 * 0.04)
    only_plain = estimate.StepCost(Timing({False: 0.12}, 0.0, 1.5, 0.0, 10.0), "measured")
    assert trial(1, timed=only_plain) == pytest.approx(trial(0, timed=only_plain))


def test_measured_dry_run_without_its_data_says_so(capsys, tmp_path):
    """A measured estimate trains on the data: where there is none, a clear error and exit 2."""
    code = ablation("--dry-run", "--smoke", "--set", "preset=cpu", "--set", "estimate.measure_steps=6",
                    "--set", f"base.data.source=jsonl:{tmp_path / 'missing'}", "--storage-path", str(tmp_path))
    assert code == 2 and "missing does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("every", [("train.diag_every=5", "train.shadow_every=10"),
                                   ("train.diag_every=3", "train.shadow_every=2"),
                                   ("train.diag_every=2", "train.shadow_every=1")])
def test_timing_separates_start_up_steps_shadow_evaluation_and_checkpoint(make_config, every):
    """A short run of a config with diagnostics and shadow comparisons on some steps only has them
    every 2nd and 4th step, 12 steps: diagnostics on 1, 2, 4, ..., 12, shadow on 1, 4, 8, 12,
    evaluations on 1, 11, 12, a checkpoint on 12. The first two steps of each kind and what step
    1 evaluates are start-up; the rest comes apart exactly."""
    from altgrad.tune.timed_run import short_run, timing

    run = short_run(make_config(*every, "train.log_interval=5", "stability.nan_patience=2"), steps=6)
    t = run.train
    assert (t.max_steps, t.diag_every, t.shadow_every, t.log_interval, t.eval_interval) == (12, 2, 4, 1, 11)
    assert run.stability.nan_patience > t.max_steps and run.stability.shift_patience is None
    diag, plain, shadow, evaluation, checkpoint = 0.3, 0.1, 0.05, 1.0, 2.0
    extra = {1: 30.0 + shadow + evaluation, 2: 5.0, 3: 9.0, 4: shadow, 5: 0.7, 8: shadow, 11: evaluation,
             12: shadow + evaluation + checkpoint}  # 30 + 5 + 9 + 0.7 of it start-up
    durations = [(diag if step % 2 == 0 or step == 1 else plain) + extra.get(step, 0.0) for step in range(1, 13)]
    ends = [sum(durations[:i + 1]) for i in range(12)]
    timed = timing(ends, t)
    assert timed.step_s == pytest.approx({True: diag, False: plain})
    assert (timed.shadow_s, timed.eval_s, timed.checkpoint_s) == pytest.approx((shadow, evaluation, checkpoint))
    assert timed.startup_s == pytest.approx(30 + 5 + 9 + 0.7)


def test_measured_estimate_times_each_cost_group(monkeypatch, capsys):
    """A grid axis that changes what a step costs (here the batch) is measured per value: a bf16
    and a quantized run of each, every trial charged its own group's cost; formats, optimizers and
    seeds share one. A compiled unit that groups share (per-tensor kernels compile for any batch)
    is charged once, at what the group that compiled it measured: the other found it cached."""
    from altgrad.tune import estimate

    timed: list[tuple[str, int]] = []

    def measure(run, steps, cpus, cache, gpu_fraction):  # a step: 10 ms per sequence, quantized twice
        batch = run.train.batch_size
        timed.append((run.quant.format, batch))
        step = 0.01 * batch * (1 if run.quant.is_baseline else 2)
        compile_s = (3.0 if run.quant.is_baseline else 7.0) if batch == 8 else 0.5  # 8's compiled the kernels
        return estimate.StepCost(Timing({False: step, True: step}, 0.0, 0.0, 0.0, 1.0), "measured", compile_s)

    monkeypatch.setattr(estimate, "measure", measure)
    out = dry_run(capsys, "--smoke", "--set", "estimate.measure_steps=6", "--set", "estimate.trial_overhead_s=0",
                  "--set", "estimate.sweep_overhead_s=0", "--set", "preset=cpu", "--set", "grid.formats=[bf16, e4m3, e5m2]",
                  "--set", "grid.seeds=[1, 2]", "--set", "grid.axes={train.batch_size: [4, 8]}")
    assert sorted(timed) == [("bf16", 4), ("bf16", 8), ("e4m3", 4), ("e4m3", 8)]
    steps = 20  # each trial: start-up 1 s + 20 steps
    trials = sum(2 * (1 + steps * 0.01 * batch) + 4 * (1 + steps * 0.02 * batch) for batch in (4, 8))
    assert f"estimated wall time: {(trials + 3.0 + 7.0) / 2:.0f} s for 12 trials" in out
    assert "2 kernel sets compiled once each, 10 s in all" in out
    assert "bf16 train.batch_size=4 40 ms/step" in out and "quantized train.batch_size=8 160 ms/step" in out

    def measure_eval(run, steps, cpus, cache, gpu_fraction):  # an evaluation: 1 s per batch
        timed.append((run.quant.format, run.train.eval_iters))
        return estimate.StepCost(Timing({False: 0.0}, 0.0, 1.0 * run.train.eval_iters, 0.0, 0.0), "measured")

    timed.clear()
    monkeypatch.setattr(estimate, "measure", measure_eval)
    evals = dry_run(capsys, "--smoke", "--set", "estimate.measure_steps=6", "--set", "estimate.trial_overhead_s=0",
                    "--set", "estimate.sweep_overhead_s=0", "--set", "preset=cpu", "--set", "grid.formats=[bf16, e4m3]",
                    "--set", "grid.axes={train.eval_iters: [2, 6]}")
    assert sorted(timed) == [("bf16", 2), ("bf16", 6), ("e4m3", 2), ("e4m3", 6)]
    assert f"estimated wall time: {2 * 5 * (2 + 6) / 2:.0f} s for 4 trials" in evals  # 5 evaluations each
