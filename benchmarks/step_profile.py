"""Where a training step's time goes: kernel launches, host syncs and the top ops, per variant.

Builds the variants of `train_step.py`, warms them up, then profiles one step of each with
torch.profiler and prints launches, CPU and device time and the ops that cost most. On CUDA it
also lists every host sync with the Python lines that caused it (SPEC §5 allows one per step).
`--callers N` profiles one more step with Python's stack and lists the N altgrad functions whose
native calls (ATen ops, compiled graphs, kernel launches) took most host time, with the kernel and
CUDA graph launches beneath them: on a GPU, which code launches the kernels a step still launches
one by one.

`--phases N` times N steps of each variant instead, interleaved as in `train_step.py`, and prints
the median wall time of each phase of `Trainer.train_step` side by side: the compiled forward and
the backward, each call the diagnostics make (`Diagnostics`' phases, bit tracking, the bit
positions file), the shadow, the optimizer step, and `other`, what no timed call covers (the
schedule, clipping and the NaN probe, building the bit positions' row, re-quantizing stored
weights, zeroing the grads, the host sync). It is how the diagnostics' cost is taken apart
(docs/design.md); a phase a variant does not run is `-`. On CUDA a phase is the host's time to
queue its work: the device time not yet done lands in `other`, at the step's host sync. Where the
diagnostics replay CUDA graphs (`train.cuda_graphs`), `after_backward` and `after_update` are the
replays, and the calls inside them run only in the steps that record.

    python benchmarks/step_profile.py [--preset cpu|gpu|host] [--variants bf16,e4m3,e4m3+diag] [--rows 15]
                                      [--callers N] [--phases N] [--set KEY=VALUE] [--smoke]

`--preset host` is `train_step.py`'s host-bound proxy (the same bundle of overrides); `--smoke`
warms up for one step instead of four (and with `--phases`, times 3 steps whatever N says).
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEventAvg
from torch.profiler import DeviceType, ProfilerActivity, profile
from train_step import (
    VARIANTS,
    add_preset_arguments,
    add_variants_argument,
    build,
    chosen_variants,
    interleaved,
    preset_overrides,
    timed_step,
)

from altgrad.train import Trainer

# The calls a diagnostic step makes on `Diagnostics`.
DIAGNOSTICS_CALLS = ("begin", "after_backward", "activation_metrics", "gradient_metrics", "snapshot",
                     "after_update", "update_metrics", "quant_metrics", "end")


def diagnostics_phase(call: str) -> str:
    return f"diagnostics.{call}"


# `PhaseClock`'s phases, in the order `Trainer.train_step` runs them.
PHASES = (diagnostics_phase("begin"), "forward", "backward", diagnostics_phase("after_backward"),
          diagnostics_phase("activation_metrics"), diagnostics_phase("gradient_metrics"), diagnostics_phase("snapshot"),
          "shadow", "optimizer step", diagnostics_phase("after_update"), diagnostics_phase("update_metrics"),
          diagnostics_phase("quant_metrics"), diagnostics_phase("end"), "bit tracking", "bit positions file")
OTHER = "other"  # what no timed call covers (see the module docstring)
STEP = "step"  # the whole step


def host_syncs(step) -> collections.Counter:
    """Syncs during step(), keyed by the altgrad/torch.optim lines on the stack (CUDA only)."""
    found: collections.Counter = collections.Counter()

    def record(message, *args, **kwargs) -> None:
        if "called a synchronizing" in str(message):
            frames = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]
                      if "altgrad" in f.filename or "torch/optim" in f.filename]
            found[" < ".join(reversed(frames[-4:])) or "(no altgrad frame)"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return found


class ExclusiveTimes:
    """Seconds per phase spent in the calls `timed` wraps, each call's own time: a timed call made
    inside another counts for its phase alone (the shadow's FP32 backward is the shadow's, not the
    step's backward), so the phases never count a moment twice."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: list[list[float]] = []  # per timed call under way: [start, time in timed calls inside it]

    def timed(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def call(*args, **kwargs):
            self._open.append([time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, inside = self._open.pop()
                elapsed = time.perf_counter() - start
                self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed - inside
                if self._open:
                    self._open[-1][1] += elapsed

        return call


class PhaseClock:
    """Wall time per phase (PHASES) of one trainer's steps, taken by wrapping the calls `train_step`
    makes on the trainer's own objects, and `torch.autograd.backward` (process-wide) during a timed
    step. Each phase's time is its own (`ExclusiveTimes`), so a step's phases and `OTHER` add up to
    the step."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.steps: list[dict[str, float]] = []  # per timed step: phase -> seconds, OTHER and STEP too
        self.times = ExclusiveTimes()  # the step under way (untimed steps too, then dropped)
        self._backward = self.times.timed(torch.autograd.backward, "backward")
        self._wrap(trainer, "forward", "forward")
        self._wrap(trainer.optimizer, "step", "optimizer step")
        for call in DIAGNOSTICS_CALLS:
            self._wrap(trainer.diagnostics, call, diagnostics_phase(call))
        if trainer.bit_tracker is not None:
            self._wrap(trainer.bit_tracker, "observe", "bit tracking")
        self._wrap(trainer.bit_file, "write", "bit positions file")
        if trainer.shadow is not None:
            self._wrap(trainer.shadow, "cosines", "shadow")

    def _wrap(self, owner: object, name: str, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"{phase!r} is not one of PHASES")
        setattr(owner, name, self.times.timed(getattr(owner, name), phase))

    def step(self, step: int) -> None:
        """One timed step (`train_step.timed_step`)."""
        self.times.seconds = {}
        backward, torch.autograd.backward = torch.autograd.backward, self._backward
        try:
            total = timed_step(self.trainer, step)
        finally:
            torch.autograd.backward = backward
        phases = self.times.seconds
        self.steps.append({**phases, OTHER: total - sum(phases.values()), STEP: total})

    def medians(self) -> dict[str, float]:
        """Each phase's median over the steps that ran it."""
        return {phase: statistics.median(s[phase] for s in self.steps if phase in s)
                for phase in (*PHASES, OTHER, STEP) if any(phase in s for s in self.steps)}


def phase_table(medians: dict[str, dict[str, float]]) -> str:
    """Milliseconds per phase (rows, in the order of PHASES) and variant (columns); `-` where a
    variant does not run a phase."""
    rows = [phase for phase in (*PHASES, OTHER, STEP) if any(phase in m for m in medians.values())]
    width = max(12, *(len(v) + 2 for v in medians))
    lines = [f"{'phase (median ms)':<30}" + "".join(f"{v:>{width}}" for v in medians)]
    for phase in rows:
        cells = (f"{1e3 * m[phase]:.3f}" if phase in m else "-" for m in medians.values())
        lines.append(f"{phase:<30}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def time_phases(variants: list[str], common: list[str], steps: int, warmup: int) -> dict[str, dict[str, float]]:
    """`PhaseClock` medians of each variant over `steps` steps after `warmup`, steps interleaved."""
    with tempfile.TemporaryDirectory() as tmp:
        clocks = {name: PhaseClock(build([*common, *VARIANTS[name]], steps + warmup, Path(tmp) / name))
                  for name in variants}
        for step, name in interleaved(variants, range(2, warmup + steps + 2)):  # step 1 would evaluate
            if step > warmup + 1:
                clocks[name].step(step)
            else:
                clocks[name].trainer.train_step(step)
    return {name: clock.medians() for name, clock in clocks.items()}


KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
PYTHON_FRAME = re.compile(r"^(?P<path>.+)\((?P<line>\d+)\): (?P<name>.+)$")  # a with_stack Python event's name
PYTHON_CALL = re.compile(rf"{PYTHON_FRAME.pattern}|^<built-in .+>$|^nn\.Module: .+$")  # the tracer's other events


def is_python_call(event: Any) -> bool:
    """Whether a profiled event is one of the Python tracer's calls rather than native work.
    torch 2.11 (the GPU machines' image) has no `FunctionEvent.is_python_function`; there the
    tracer's events are known by the names it gives them: a function, a builtin, a module."""
    flag = getattr(event, "is_python_function", None)
    return bool(PYTHON_CALL.match(event.name)) if flag is None else flag


@dataclass
class CallerRow:
    """What one chain of altgrad functions started in a profiled step: native calls (ATen ops,
    compiled graphs, launches made straight from Python), their host time, and the kernel and CUDA
    graph launches beneath them."""

    calls: int = 0
    host_us: float = 0.0
    kernels: int = 0
    graphs: int = 0


def altgrad_frames(event: Any) -> list[str]:
    """The altgrad functions above a profiled event, innermost first, each as `function (file:line)`
    with the line the function starts at: the profiler records a Python call, not the line it
    made its calls from."""
    frames = []
    parent = event.cpu_parent
    while parent is not None:
        match = PYTHON_FRAME.match(parent.name) if is_python_call(parent) else None
        if match and "altgrad/" in match["path"]:
            frames.append(f"{match['name']} ({Path(match['path']).name}:{match['line']})")
        parent = parent.cpu_parent
    return frames


def launches_beneath(event: Any, names: tuple[str, ...]) -> int:
    return (event.name in names) + sum(launches_beneath(child, names) for child in event.cpu_children)


def op_callers(events: Iterable[Any], depth: int = 2) -> dict[str, CallerRow]:
    """The native work of a step profiled `with_stack=True`, by the altgrad functions that started
    it (the `depth` innermost, as `inner < outer`; none on autograd's backward thread, CUDA's).
    Counted at the top of each native call tree (an event that is not a Python function, under one
    that is or under none), so an op inside another, or a kernel launch inside an op, is not
    counted twice. Where the host's time goes on a GPU, whose eager launches are its cost."""
    rows: dict[str, CallerRow] = collections.defaultdict(CallerRow)
    for event in events:
        parent = event.cpu_parent
        if is_python_call(event) or (parent is not None and not is_python_call(parent)):
            continue
        row = rows[" < ".join(altgrad_frames(event)[:depth]) or "(no altgrad frame)"]
        row.calls += 1
        row.host_us += event.cpu_time_total
        row.kernels += launches_beneath(event, KERNEL_LAUNCHES)
        row.graphs += launches_beneath(event, ("cudaGraphLaunch",))
    return dict(rows)


def caller_table(rows: dict[str, CallerRow], limit: int, cuda: bool) -> str:
    """The `limit` callers with the most host time, one line each."""
    head = f"{'calls':>6} {'host ms':>8}" + (f" {'kernels':>7} {'graphs':>6}" if cuda else "") + "  called from"
    lines = [head]
    for site, row in sorted(rows.items(), key=lambda item: -item[1].host_us)[:limit]:
        counts = f" {row.kernels:7d} {row.graphs:6d}" if cuda else ""
        lines.append(f"{row.calls:6d} {row.host_us / 1e3:8.3f}{counts}  {site}")
    return "\n".join(lines)


def profile_summary(ops: Iterable[FunctionEventAvg], cuda: bool) -> str:
    """The step's CPU time and, on CUDA, its device time and the host's launches.

    Device time is the sum over the device's own events (kernels, copies). A host op's device time
    is the kernels it launched, which the device's events count already: a replayed CUDA graph's
    whole run is the self device time of the host op that launched it, so summing every op would
    count each replayed kernel twice."""
    line = f"CPU {sum(e.self_cpu_time_total for e in ops) / 1e3:.1f} ms"
    if cuda:
        device = sum(e.self_device_time_total for e in ops if e.device_type != DeviceType.CPU)
        kernels = sum(e.count for e in ops if e.key in KERNEL_LAUNCHES)
        graphs = sum(e.count for e in ops if e.key == "cudaGraphLaunch")
        line += f"; device {device / 1e3:.1f} ms; {kernels} kernel launches, {graphs} graph launches"
    return line


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_preset_arguments(ap)
    add_variants_argument(ap, "bf16,e4m3,e4m3+diag")
    ap.add_argument("--rows", type=int, default=15, help="ops listed per variant")
    ap.add_argument("--phases", type=int, metavar="N", help="time N steps per variant, phase by phase, instead")
    ap.add_argument("--callers", type=int, default=0, metavar="N",
                    help="then profile one more step with Python's stack and list the N altgrad "
                         "functions whose native work took most host time")
    ap.add_argument("--smoke", action="store_true", help="one warm-up step, to check the script runs")
    args = ap.parse_args(argv)
    variants, common = chosen_variants(ap, args.variants), preset_overrides(ap, args)
    if args.phases is not None:
        if args.phases < 1:
            ap.error("--phases needs at least one step")
        steps, warmup = (3, 1) if args.smoke else (args.phases, 4)
        print(f"{steps} steps per variant after {warmup} warm-up steps")
        print(phase_table(time_phases(variants, common, steps, warmup)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            trainer = build([*common, *VARIANTS[name]], 100, Path(tmp) / name)
            for step in range(2, 3 if args.smoke else 6):  # step 1 would evaluate
                trainer.train_step(step)
            cuda = trainer.device.type == "cuda"
            print(f"== {name}")
            if cuda:
                syncs = host_syncs(lambda: trainer.train_step(6))  # noqa: B023 - called at once
                print(f"host syncs: {sum(syncs.values())}")
                for where, n in syncs.most_common():
                    print(f"  {n:4d}  {where}")
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                trainer.train_step(7)
                if cuda:
                    torch.cuda.synchronize()
            ops = prof.key_averages()
            print(profile_summary(ops, cuda))
            sort = "self_device_time_total" if cuda else "self_cpu_time_total"
            print(ops.table(sort_by=sort, row_limit=args.rows))
            if args.callers:  # a step of its own: recording Python's stack slows the host
                with profile(activities=activities, with_stack=True) as traced:
                    trainer.train_step(8)
                    if cuda:
                        torch.cuda.synchronize()
                print(caller_table(op_callers(traced.events()), args.callers, cuda))


if __name__ == "__main__":
    main()
