"""`--dry-run`'s time and cost estimate: how long the grid takes here, and what it costs on GPUs.

Per-step time comes from one of two sources, and the output says which:
- **measured**: a short run of the grid's own trials on this machine (one bf16 and the slowest
  quantized point of each `cost_group`: a grid axis on the model, the batch, `train.compile` or
  `train.eval_iters` makes several), each in a fresh process holding a trial's share of the machine (`timed_run`):
  its steady steps with and without diagnostics, each trial charged for the steps of each kind it
  has, and what a shadow comparison, an evaluation and a checkpoint add. The runs compile into one
  cache, first empty, as the sweep's trials do into the experiment's; one that compiles (its step
  graphs, or with `train.compile` off its per-tensor kernels) runs twice: cold, then warm. The warm
  run's start-up is what every trial pays; the difference, the compiling, is paid once per
  distinct compiled unit of the grid (`compile_keys`): later trials load it from the cache;
- **stored**: `estimate.step_time_s[<preset>]` from the config, when the preset cannot run here
  (the gpu preset on a machine without CUDA) or `measure_steps` is 0; an evaluation batch is then
  taken as a third of a step (forward only). A trial's start-up (`estimate.startup_s`) and each
  distinct compiled unit's compiling, once (`estimate.compile_s`), are stored per preset and per
  kind of unit (`unit_kind`: step graphs, or a set of per-tensor kernels, which starts and
  compiles faster); a kind with nothing stored is not counted, and the estimate says so.
A trial costs `estimate.trial_overhead_s` (what Ray adds) + start-up + its steps, evaluations,
shadow comparisons and checkpoints, each at its cost; every trial is assumed to run its full budget
(early stops only shorten it), and trials run `concurrency` at a time, after Ray's start and before
the report (`estimate.sweep_overhead_s`).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from altgrad.config import QuantConfig, RunConfig
from altgrad.metrics import is_checkpoint_step, is_diagnostic_step, is_eval_step, is_shadow_step
from altgrad.precision import BASELINE, FORMAT_PLACEHOLDER
from altgrad.quant.formats import get_format
from altgrad.quant.kernels import compiling_disabled, family
from altgrad.tune.config import KERNEL_SET, STEP_GRAPH, EstimateSettings, SweepConfig
from altgrad.tune.timed_run import Timing, short_run, timed_run


@dataclass(frozen=True)
class StepCost:
    """What one trial of a kind (bf16, or quantized) costs: its parts (`timed_run.Timing`), how
    they were obtained, and what compiling one of its compiled units (`compile_keys`) costs, once
    per unit of the grid (None: unknown)."""

    timing: Timing
    source: str
    compile_s: float | None = 0.0

    def trial_s(self, run: RunConfig, overhead_s: float) -> float:
        """A trial of `run` at full budget: Ray's `overhead_s`, its start-up and each of its steps,
        evaluations, shadow comparisons and checkpoints, as the trainer schedules them."""
        t, c = run.train, self.timing
        steps = range(1, t.max_steps + 1)
        return (overhead_s + c.startup_s + sum(c.step(is_diagnostic_step(t, s)) for s in steps)
                + sum(is_eval_step(t, s) for s in steps) * c.eval_s
                + sum(is_shadow_step(t, s) for s in steps) * c.shadow_s
                + sum(is_checkpoint_step(t, s) for s in steps) * c.checkpoint_s)


def measure(run: RunConfig, steps: int, cpus: int, cache: Path, gpu_fraction: float = 0.0) -> StepCost:
    """Time a short run of `run` (`timed_run.short_run`, at least `steps` steps) on this machine as a
    trial takes it: a fresh process holding the trial's `cpus` and `gpu_fraction`, compiling into
    `cache`. A run that compiles runs again from that cache, as a later trial of the same compiled
    units does: its steps and start-up are a trial's, and what the cold run's start-up took longer
    is the compiling, split evenly over its units. Like a sweep's trials, the runs measured for one
    estimate share one cache: the first builds what every unit needs once (inductor's C++ headers,
    the kernels all formats share), and a later one pays only for its own."""
    from altgrad.data import prepare_dataset

    short = short_run(run, steps)
    prepare_dataset(short.data)  # before the clock: a sweep prepares the data once, not per trial
    units = len(compile_keys(short))
    with tempfile.TemporaryDirectory() as tmp:
        cold = timed_run(short, Path(tmp) / "cold", cache, cpus, gpu_fraction)
        warm = timed_run(short, Path(tmp) / "warm", cache, cpus, gpu_fraction) if units else cold
    return StepCost(warm, "measured", max(cold.startup_s - warm.startup_s, 0.0) / units if units else 0.0)


def stored(run: RunConfig, step_s: float, compile_s: float | None, startup_s: float) -> StepCost:
    """The stored per-preset step time, the same for every kind of step (an evaluation batch a
    third of it; nothing known of shadow comparisons or checkpoints), and start-up."""
    return StepCost(Timing({False: step_s, True: step_s}, shadow_s=0.0, eval_s=run.train.eval_iters * step_s / 3,
                           checkpoint_s=0.0, startup_s=startup_s), "stored", compile_s)


def unit_kind(run: RunConfig) -> str:
    """What a run compiles: step graphs (`train.compile`), or else a set of per-tensor kernels."""
    return STEP_GRAPH if run.train.compile else KERNEL_SET


def compile_keys(run: RunConfig) -> set[str]:
    """What a run compiles, each unit keyed by what it depends on (a JSON list, its kind first);
    none where compiling is off (`ALTGRAD_NO_COMPILE`). With `train.compile`, its step graphs: one
    for its diagnostic steps and one for the others, where it has both kinds, each on the model,
    the quantization settings, the batch shape and autocast (not the seed, the optimizer or its
    schedule, which act outside the graph). Without, its per-tensor kernels: one set on the
    quantization settings with each format as its kernel family (`kernels.family`: one compiled
    kernel serves every format of a family), the model's depth and the optimizer (kernels over a
    list of layers compile one graph per list length; the manifold optimizer's update is a kernel)
    and whether it runs diagnostics (their kernels count and compare codes); not the seed or the
    tensors' shapes (the kernels compile for any). Trials that share a key share its compiling."""
    t = run.train
    if compiling_disabled():
        return set()
    diagnostics = {is_diagnostic_step(t, step) for step in range(1, t.max_steps + 1)}
    if unit_kind(run) == KERNEL_SET:
        return {json.dumps([KERNEL_SET, kernel_families(run.quant), run.model.n_layer, run.optim.name,
                            True in diagnostics], sort_keys=True)}
    shared = [STEP_GRAPH, run.model.model_dump(mode="json"), run.quant.model_dump(mode="json"), t.batch_size,
              t.autocast]
    return {json.dumps([*shared, kind], sort_keys=True) for kind in diagnostics}


def kernel_families(quant: QuantConfig) -> dict[str, Any]:
    """`quant`'s settings with each format named by its kernel family ((m0, ftz)), as the
    per-tensor kernels compile them."""
    def family_of(name: str) -> str | tuple[bool, bool]:
        return name if name in (BASELINE, FORMAT_PLACEHOLDER) else family(get_format(name))

    settings = quant.model_dump(mode="json")
    settings.update(format=family_of(quant.format), grad_format=family_of(quant.grad_format))
    if isinstance(quant.precision, list):
        settings["precision"] = [{**rule, "format": family_of(rule["format"])} for rule in settings["precision"]]
    return settings


def compiling(runs: list[RunConfig], cost_of: Callable[[RunConfig], StepCost]) -> tuple[float, dict[str, int]]:
    """The grid's distinct compiled units: seconds to compile them, once each, at the largest
    `compile_s` of the runs that compile each (cost groups can share a unit: the group timed first
    compiled it, a later one found it in the shared cache); how many there are of each kind
    (STEP_GRAPH, KERNEL_SET). A unit whose cost is not known (None: nothing stored for its kind) counts
    nothing; the estimate says so."""
    units: dict[str, list[float | None]] = {}
    for run in runs:
        for key in compile_keys(run):
            units.setdefault(key, []).append(cost_of(run).compile_s)
    known = [max(costs) for costs in units.values() if None not in costs]
    kinds = [json.loads(key)[0] for key in units]
    return sum(known), {k: kinds.count(k) for k in (STEP_GRAPH, KERNEL_SET) if k in kinds}


def kind_name(kind: str) -> str:
    """A kind of compiled unit in prose: 'step graph', 'kernel set'."""
    return kind.replace("_", " ")


def units_text(kind: str, count: int) -> str:
    """'6 step graphs', '1 kernel set'."""
    return f"{count} {kind_name(kind)}{'s' * (count != 1)}"


def cost_group(run: RunConfig) -> str:
    """What sets a trial's cost per step and per evaluation, as far as the estimate tells trials
    apart: bf16 or quantized (every quantized trial costs what the group's slowest, quantized
    throughout, does), the model, the batch, whether it compiles its step, autocast and the
    evaluation's batches. Not the format, the optimizer or the seed: within a group they change a
    step's time by a few per cent (docs/design.md)."""
    t = run.train
    model = {f"model.{k}": v for k, v in run.model.model_dump(mode="json").items()}
    return json.dumps({"quantized": not run.quant.is_baseline, **model, "train.batch_size": t.batch_size,
                       "train.compile": t.compile, "train.autocast": t.autocast, "train.eval_iters": t.eval_iters},
                      sort_keys=True)


def group_labels(groups: dict[str, RunConfig]) -> list[str]:
    """"bf16" / "quantized" for each cost group, with the settings that tell its groups apart."""
    keys = [json.loads(key) for key in groups]
    varies = [k for k in keys[0] if k != "quantized" and any(key[k] != keys[0][k] for key in keys)]
    return [("quantized" if key["quantized"] else BASELINE)
            + "".join(f" {k}={json.dumps(key[k])}" for k in varies) for key in keys]


def estimate_lines(cfg: SweepConfig, runs: list[RunConfig], concurrency: int, can_measure: bool) -> list[str]:
    """The dry-run's estimate: wall time here (and GPU-hours and cost for a GPU preset)."""
    e = cfg.estimate
    if not runs or concurrency < 1:
        return []
    stored_step = e.step_time_s.get(cfg.preset)
    measured = bool(can_measure and e.measure_steps)
    if not measured and stored_step is None:
        return [f"time estimate: n/a (preset {cfg.preset} cannot run here and the config has no "
                f"estimate.step_time_s.{cfg.preset})"]
    groups: dict[str, RunConfig] = {}  # each cost group's run to time: bf16 first, then the slowest quantized
    for run in sorted(runs, key=lambda r: (not r.quant.is_baseline, r.quant.precision != "all")):
        groups.setdefault(cost_group(run), run)
    if measured:
        with tempfile.TemporaryDirectory() as tmp:  # the experiment's compile cache, as it starts
            costs = {key: measure(run, e.measure_steps, cfg.resources.cpus_per_trial, Path(tmp),
                                  cfg.resources.gpu_per_trial) for key, run in groups.items()}
    else:
        costs = {key: stored(run, stored_step, stored_seconds(e, "compile_s", cfg.preset, unit_kind(run)),
                             stored_seconds(e, "startup_s", cfg.preset, unit_kind(run)) or 0.0)
                 for key, run in groups.items()}

    def cost_of(run: RunConfig) -> StepCost:
        return costs[cost_group(run)]

    compiling_s, units = compiling(runs, cost_of)
    if measured:
        how = "; ".join(f"{k} {c.timing.step(False) * 1e3:.0f} ms/step ({c.timing.step(True) * 1e3:.0f} with "
                        f"diagnostics), eval {c.timing.eval_s:.2f} s, checkpoint {c.timing.checkpoint_s:.2f} s, "
                        f"start-up {c.timing.startup_s:.1f} s"
                        + (f", shadow comparison {c.timing.shadow_s * 1e3:.0f} ms" if c.timing.shadow_s else "")
                        + (f", compiling {c.compile_s:.1f} s per unit" if c.compile_s else "")
                        for k, c in zip(group_labels(groups), costs.values(), strict=True))
        compiled = (f"; {' and '.join(units_text(k, n) for k, n in units.items())} compiled once each, "
                    f"{compiling_s:.0f} s in all") if units else ""
        source = f"measured here, a short run of each ({how}){compiled}"
    else:
        why = "estimate.measure_steps = 0" if can_measure else "this machine cannot run the preset"
        kinds = sorted({unit_kind(run) for run in runs}, reverse=True)  # step graphs first
        started = "".join(stored_text("start-up" + (f" ({kind_name(k)}s)" if len(kinds) > 1 else ""), " a trial",
                                      e, "startup_s", cfg.preset, k) for k in kinds)
        compiled = "".join(stored_text(f"compiling its {units_text(k, n)}", " each, once", e, "compile_s",
                                       cfg.preset, k) for k, n in units.items())
        source = f"stored: estimate.step_time_s.{cfg.preset} = {stored_step:g} s per step ({why}){started}{compiled}"
    total_s = compiling_s + sum(cost_of(r).trial_s(r, e.trial_overhead_s) for r in runs)
    wall_s = e.sweep_overhead_s + total_s / min(concurrency, len(runs))
    lines = [f"estimated wall time: {_duration(wall_s)} for {len(runs)} trials at full budget, "
             f"{min(concurrency, len(runs))} at a time (+{e.trial_overhead_s:g} s per trial and "
             f"{e.sweep_overhead_s:g} s per sweep for Ray: estimate.trial_overhead_s, sweep_overhead_s); {source}"]
    gpu = cfg.resources.gpu_per_trial
    if gpu > 0:
        gpu_hours = total_s * gpu / 3600
        lines.append(f"GPU time: {gpu_hours:.2f} GPU-hours ({gpu:g} GPU per trial) = "
                     f"${gpu_hours * e.usd_per_gpu_hour:.2f} at ${e.usd_per_gpu_hour:g}/GPU-hour "
                     "(estimate.usd_per_gpu_hour)")
    return lines


def stored_seconds(e: EstimateSettings, field: str, preset: str, kind: str) -> float | None:
    """`estimate.<field>.<preset>.<kind>` (`startup_s` or `compile_s`), None when not stored."""
    return getattr(e, field).get(preset, {}).get(kind)


def stored_text(what: str, per: str, e: EstimateSettings, field: str, preset: str, kind: str) -> str:
    """The stored estimate's clause on `what` (a kind's start-up, or compiling its units): the
    seconds `stored_seconds` finds, `per` what, or that it is not counted."""
    seconds = stored_seconds(e, field, preset, kind)
    where = f"estimate.{field}.{preset}.{kind}"
    return f"; {what} not counted (no {where})" if seconds is None else f"; {what}: {seconds:g} s{per} ({where})"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h ({math.ceil(minutes)} min)"

