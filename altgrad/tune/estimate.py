"""`--dry-run`'s time and cost estimate: how long the grid takes here, and what it costs on GPUs.

Per-step time comes from one of two sources, and the output says which:
- **measured**: a short in-process warm-up of the grid's own runs on this machine (one bf16 and
  the slowest quantized point, torch held to the trial's CPU share), timed per step after the first
  two (which compile), plus the final evaluation's extra time;
- **stored**: `estimate.step_time_s[<preset>]` from the config, when the preset cannot run here (the
  gpu preset on a machine without CUDA); an evaluation batch is then taken as a third of a step
  (forward only), and each distinct step graph of the grid (`step_graph_keys`) costs
  `estimate.compile_s[<preset>]` once: later trials load it from the experiment's compile cache.
A trial costs start-up + steps × step time + evaluations × evaluation time, every trial is assumed
to run its full budget (early stops only shorten it), and trials run `concurrency` at a time.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from altgrad.config import RunConfig, deep_merge
from altgrad.metrics import is_diagnostic_step, is_eval_step
from altgrad.precision import BASELINE
from altgrad.tune.config import SweepConfig

QUANTIZED = "quantized"  # the step cost of the grid's quantized runs (the slowest one's), by BASELINE's


@dataclass(frozen=True)
class StepCost:
    step_s: float  # one training step, diagnostics and shadow steps averaged in
    eval_s: float  # one evaluation
    startup_s: float  # building the trial and its first (compiling) steps
    source: str  # how these were obtained

    def trial_s(self, run: RunConfig, overhead_s: float) -> float:
        t = run.train
        evals = sum(is_eval_step(t, s) for s in range(1, t.max_steps + 1))
        return overhead_s + self.startup_s + t.max_steps * self.step_s + evals * self.eval_s


def measure(run: RunConfig, steps: int, threads: int) -> StepCost:
    """Train `steps` steps of `run` here in a temporary directory and time them."""
    import torch

    from altgrad.train import Trainer

    steps = max(steps, 6)
    short = RunConfig.model_validate(deep_merge(run.model_dump(mode="json"), {"train": {
        "max_steps": steps, "warmup_steps": 1, "eval_interval": steps + 1,
        "checkpoint_interval": steps + 1}}))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    stamps: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            begin = time.perf_counter()
            trainer = Trainer(short, Path(tmp) / "run")
            trainer.fit(report=lambda metrics, ckpt: stamps.append(time.perf_counter()))
    finally:
        torch.set_num_threads(previous)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    step_s = statistics.fmean(gaps[1:-1])  # after the compiling steps, before the final evaluation
    eval_s = max(gaps[-1] - step_s, 0.0)
    return StepCost(step_s, eval_s, stamps[1] - begin - step_s, "measured")


def stored(run: RunConfig, step_s: float) -> StepCost:
    return StepCost(step_s, run.train.eval_iters * step_s / 3, 0.0, "stored")


def step_graph_keys(run: RunConfig) -> set[str]:
    """The step graphs a run compiles (none with `train.compile` off): one for its diagnostic steps
    and one for the others, where it has both kinds, each keyed by what it depends on -- the model,
    the quantization settings, the batch shape and autocast. Not the seed, the optimizer or its
    schedule: they act outside the graph, so trials that differ only in those share one compile."""
    t = run.train
    if not t.compile:
        return set()
    shared = [run.model.model_dump(mode="json"), run.quant.model_dump(mode="json"), t.batch_size, t.autocast]
    kinds = {is_diagnostic_step(t, step) for step in range(1, t.max_steps + 1)}
    return {json.dumps([*shared, diagnostics], sort_keys=True) for diagnostics in kinds}


def compiling(cfg: SweepConfig, runs: list[RunConfig]) -> tuple[float, str]:
    """Seconds the grid's distinct step graphs take to compile, once each, at the stored
    `estimate.compile_s`, and how the estimate line says so ("" when no run compiles one)."""
    graphs = len(set().union(*map(step_graph_keys, runs)))
    graph_s = cfg.estimate.compile_s.get(cfg.preset)
    if not graphs:
        return 0.0, ""
    if graph_s is None:
        return 0.0, f"; compiling its {graphs} step graphs not counted (no estimate.compile_s.{cfg.preset})"
    return graphs * graph_s, f"; {graphs} step graphs compiled once each at {graph_s:g} s (estimate.compile_s)"


def estimate_lines(cfg: SweepConfig, runs: list[RunConfig], concurrency: int, can_measure: bool) -> list[str]:
    """The dry-run's estimate: wall time here (and GPU-hours and cost for a GPU preset)."""
    e = cfg.estimate
    if not runs or concurrency < 1:
        return []
    stored_step = e.step_time_s.get(cfg.preset)
    compiling_s = 0.0  # measured: inside each trial's start-up
    if can_measure and e.measure_steps:
        quantized = [r for r in runs if r.quant.format != BASELINE]
        slowest = max(quantized, key=lambda r: r.quant.precision == "all", default=None)
        baseline = next((r for r in runs if r.quant.format == BASELINE), None)
        costs = {k: measure(r, e.measure_steps, cfg.resources.cpus_per_trial)
                 for k, r in ((BASELINE, baseline), (QUANTIZED, slowest)) if r is not None}
        how = "; ".join(f"{k} {c.step_s * 1e3:.0f} ms/step, eval {c.eval_s:.2f} s, start-up "
                        f"{c.startup_s:.1f} s" for k, c in costs.items())
        source = f"measured here over {max(e.measure_steps, 6)} steps ({how})"
    elif stored_step is not None:
        costs = {BASELINE: stored(runs[0], stored_step), QUANTIZED: stored(runs[0], stored_step)}
        why = "estimate.measure_steps = 0" if can_measure else "this machine cannot run the preset"
        compiling_s, how = compiling(cfg, runs)
        source = f"stored: estimate.step_time_s.{cfg.preset} = {stored_step:g} s per step ({why}){how}"
    else:
        return [f"time estimate: n/a (preset {cfg.preset} cannot run here and the config has no "
                f"estimate.step_time_s.{cfg.preset})"]
    per_trial = [(costs.get(BASELINE) if r.quant.format == BASELINE else None)
                 or costs.get(QUANTIZED) or costs[BASELINE] for r in runs]
    total_s = compiling_s + sum(c.trial_s(r, e.trial_overhead_s)
                                for c, r in zip(per_trial, runs, strict=True))
    wall_s = total_s / min(concurrency, len(runs))
    lines = [f"estimated wall time: {_duration(wall_s)} for {len(runs)} trials at full budget, "
             f"{min(concurrency, len(runs))} at a time (+{e.trial_overhead_s:g} s per trial for "
             f"Ray's start-up); {source}"]
    gpu = cfg.resources.gpu_per_trial
    if gpu > 0:
        gpu_hours = total_s * gpu / 3600
        lines.append(f"GPU time: {gpu_hours:.2f} GPU-hours ({gpu:g} GPU per trial) = "
                     f"${gpu_hours * e.usd_per_gpu_hour:.2f} at ${e.usd_per_gpu_hour:g}/GPU-hour "
                     "(estimate.usd_per_gpu_hour)")
    return lines


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h ({math.ceil(minutes)} min)"
