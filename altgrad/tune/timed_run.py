"""A short run of a trial's config timed as a trial takes it, for `--dry-run`'s measured estimate.

The run is a fresh process (`python -m altgrad.tune.timed_run`), as every trial is, holding the
trial's share of the machine, with the compile cache it is given; it reports every step, and its
trainer never stops or shifts a format (its steps are timed, not judged). From the seconds at
which its steps end, `timing` separates what a trial pays once (start-up: building, compiling or
loading its step graphs), per step (by kind: with diagnostics and without, each its own graph),
per shadow comparison, per evaluation and per checkpoint.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from altgrad.config import RunConfig, TrainConfig, deep_merge
from altgrad.metrics import is_diagnostic_step, is_eval_step, is_shadow_step
from altgrad.tune.compile_cache import CACHE_ENV

TRITON_CACHE_ENV = "TRITON_CACHE_DIR"  # unset, Triton's cache lies inside inductor's (CACHE_ENV)


@dataclass(frozen=True)
class Timing:
    """One timed run: a steady step of each kind (diagnostics on: True); what a shadow step, an
    evaluation and a checkpoint add to a step; and the start-up (everything before steady stepping,
    less step 1's evaluation and shadow comparison, which a trial's counts include)."""

    step_s: dict[bool, float]
    shadow_s: float
    eval_s: float
    checkpoint_s: float
    startup_s: float

    def step(self, diagnostic: bool) -> float:
        """A steady step of that kind; of the other kind where only that one was timed."""
        return self.step_s.get(diagnostic, self.step_s.get(not diagnostic, 0.0))


def short_run(run: RunConfig, steps: int) -> RunConfig:
    """`run` cut to a timed run of at least `steps` steps: every step reported, an evaluation at
    the step before the last and at the last (which also checkpoints), nothing that stops the run
    or shifts a format. Diagnostics on some steps only are on every other step here, and shadow
    comparisons (if any) every 4th, so that steps with and without each get settled steps to time
    (a trial is charged for the steps it has of each): that takes 12 steps, a run without either 6.
    (It writes a metrics row every step, which a trial may not: a row costs well under a
    millisecond.)"""
    t = run.train
    diag_every = min(t.diag_every, 2)
    shadow_every = 4 if t.shadow_every else 0
    n = max(steps, 12 if diag_every == 2 or shadow_every else 6)
    return RunConfig.model_validate(deep_merge(run.model_dump(mode="json"), {
        "train": {"max_steps": n, "warmup_steps": 1, "diag_every": diag_every, "shadow_every": shadow_every,
                  "log_interval": 1, "eval_interval": n - 1, "checkpoint_interval": n},
        "stability": {"nan_patience": n + 1, "shift_patience": None}}))


def timed_run(run: RunConfig, workdir: Path, cache: Path, cpus: int, gpu_fraction: float) -> Timing:
    """`run` (a `short_run`) trained in a child process with the compile cache `cache`, timed by
    `timing`. The child is this interpreter: it imports the altgrad this process does (installed,
    as every Ray worker does)."""
    workdir.mkdir(parents=True)
    config = workdir / "run.json"
    config.write_text(json.dumps(run.model_dump(mode="json")))
    env = {k: v for k, v in os.environ.items() if k != TRITON_CACHE_ENV}
    done = subprocess.run([sys.executable, "-m", "altgrad.tune.timed_run", str(config), str(workdir / "run"),
                           str(cpus), str(gpu_fraction)], env={**env, CACHE_ENV: str(cache)},
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"timing {run.quant.format} for the estimate failed (exit {done.returncode}):\n"
                           + "\n".join(done.stderr.strip().splitlines()[-15:]))
    ends = json.loads(done.stdout.strip().splitlines()[-1])
    if len(ends) != run.train.max_steps:
        raise RuntimeError(f"timing {run.quant.format} for the estimate: {len(ends)} of "
                           f"{run.train.max_steps} steps reported")
    return timing(ends, run.train)


def timing(ends: list[float], train: TrainConfig) -> Timing:
    """The timing of a `short_run` from the seconds at which each of its steps ended, counted from
    the start of its construction.

    A step is settled once it is past the first two of its kind (the first compiles or loads that
    kind's step graph, and the first diagnostic one the diagnostics' kernels; the second records
    the graph's CUDA graph). A kind's steady step is the mean of its settled steps that neither
    evaluate nor compare with the shadow; a shadow step adds the mean excess of the settled shadow
    steps. The step before the last adds an evaluation to that; the last, an evaluation and a
    checkpoint. The start-up is what the steps before those two took beyond all that."""
    n = train.max_steps
    durations = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]
    kinds = [is_diagnostic_step(train, step) for step in range(1, n + 1)]
    shadows = [is_shadow_step(train, step) for step in range(1, n + 1)]
    plain: dict[bool, list[float]] = {}
    shadowed: list[tuple[bool, float]] = []
    for step in range(1, n - 1):
        kind, duration = kinds[step - 1], durations[step - 1]
        if kinds[:step].count(kind) > 2 and not is_eval_step(train, step):
            if shadows[step - 1]:
                shadowed.append((kind, duration))
            else:
                plain.setdefault(kind, []).append(duration)
    step_s = {kind: statistics.fmean(values) for kind, values in plain.items()}
    shadow_s = statistics.fmean(d - step_s[k] for k, d in shadowed) if shadowed else 0.0

    def steady(step: int) -> float:  # what step `step` takes without evaluating or checkpointing
        return step_s[kinds[step - 1]] + shadow_s * shadows[step - 1]

    eval_s = max(durations[n - 2] - steady(n - 1), 0.0)
    checkpoint_s = max(durations[n - 1] - steady(n) - eval_s, 0.0)
    startup_s = max(ends[n - 3] - sum(steady(step) for step in range(1, n - 1)) - eval_s, 0.0)
    return Timing(step_s, shadow_s, eval_s, checkpoint_s, startup_s)


def main(argv: list[str]) -> None:
    """The child of `timed_run`: train the run and print the seconds from the start of the
    trainer's construction to the end of each step, as one JSON list."""
    from altgrad.train import Trainer
    from altgrad.train.resources import limit_resources

    config, run_dir, cpus, gpu_fraction = argv
    limit_resources(int(cpus), float(gpu_fraction))
    run = RunConfig.model_validate(json.loads(Path(config).read_text()))
    begin = time.perf_counter()
    ends: list[float] = []
    Trainer(run, run_dir).fit(report=lambda metrics, ckpt: ends.append(time.perf_counter() - begin))
    print(json.dumps(ends))


if __name__ == "__main__":
    main(sys.argv[1:])
