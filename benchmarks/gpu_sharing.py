"""Aggregate tokens/s of N trainer processes sharing one GPU, against one process alone.

A sweep puts several trials on one GPU (`gpu_fraction: 0.25`: four at a time), each a process that
caps its memory to its share (`altgrad.train.resources.limit_resources`, as the trainable does).
What that buys is measured here without Ray, which the GPU machines' image lacks: one process
alone (no memory cap), then N processes started together, each capped at 1/N of the GPU's memory.
By default N and each process's threads are what a gpu-preset sweep gives a trial
(`SWEEP_PRESETS["gpu"]`: 4 processes, 1 thread each). Every process trains the preset's e4m3
model, its own diagnostics cadence included, for the same warm-up (untimed: compiling) and the same
timed steps, which start together behind a barrier. Aggregate tokens/s is
every process's timed tokens over the wall time from the first timed step to the last; the ratio is
against the process alone. Each step ends in the trainer's host sync, so the timing is the GPU's.
Each phase also reports its start-up: from launching its processes to their first timed step
(imports, the model, compiling or loading its graphs, the warm-up steps), what a sweep's trials
pay before their first step (`estimate.startup_s`, `estimate.compile_s`). Each phase's row is
printed when the phase ends, so a run cut short still reports the process alone.

    python benchmarks/gpu_sharing.py [--processes 4] [--cpus 1] [--preset gpu] [--steps N] [--set K=V]
                                     [--smoke]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from train_step import add_training_arguments, build, training_run

from altgrad.train.resources import limit_resources
from altgrad.tune.config import SWEEP_PRESETS

VARIANT = ["quant.format=e4m3"]  # a sweep trial: the preset's diagnostics and shadow cadence kept
# A worker waits this long for the others to finish compiling (four cold gpu-preset compiles share
# one machine's cores) before the timed steps start together.
BARRIER_TIMEOUT_S = 3600


def worker(rank: int, overrides: list[str], warmup: int, steps: int, cpus: int, gpu_fraction: float,
           workdir: str, barrier: Any, results: Any) -> None:
    """One trainer process: capped, warmed up, then `steps` timed steps once every process is ready."""
    limit_resources(cpus, gpu_fraction)
    trainer = build(overrides, warmup + steps, Path(workdir) / f"process-{rank}")
    for step in range(2, warmup + 2):  # step 1 would evaluate
        trainer.train_step(step)
    barrier.wait(timeout=BARRIER_TIMEOUT_S)
    start = time.time()  # wall clock: comparable across the processes
    for step in range(warmup + 2, warmup + steps + 2):
        trainer.train_step(step)
    end = time.time()
    t = trainer.cfg.train
    results.put({"rank": rank, "tokens": steps * t.batch_size * trainer.cfg.model.block_size,
                 "start": start, "end": end, "threads": torch.get_num_threads()})


def run_phase(processes: int, gpu_fraction: float, cpus: int, overrides: list[str], warmup: int,
              steps: int) -> dict[str, Any]:
    """`processes` workers at once; their results and the aggregate tokens/s."""
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(rank, overrides, warmup, steps, cpus, gpu_fraction, tmp,
                                                  barrier, results))
                 for rank in range(processes)]
        launched = time.time()
        for p in procs:
            p.start()
        got: list[dict[str, Any]] = []
        while len(got) < processes:
            try:
                got.append(results.get(timeout=5))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    for p in procs:
                        p.terminate()
                    raise SystemExit(f"gpu_sharing: a trainer process failed (exit code {failed[0]})") from None
        for p in procs:
            p.join()
    first = min(r["start"] for r in got)
    return {"processes": sorted(got, key=lambda r: r["rank"]),
            "tokens_per_s": sum(r["tokens"] for r in got) / (max(r["end"] for r in got) - first),
            "startup_s": first - launched}


def phase_row(name: str, phase: dict[str, Any], cap: str, alone: dict[str, Any]) -> str:
    return (f"{name:<8} {len(phase['processes']):>9} {cap:>10} {phase['tokens_per_s']:>10.0f} "
            f"{phase['tokens_per_s'] / alone['tokens_per_s']:>8.2f}x {phase['startup_s']:>8.1f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trial = SWEEP_PRESETS["gpu"]
    parser.add_argument("--processes", type=int, default=round(1 / trial["gpu_per_trial"]),
                        help="processes sharing the GPU, each capped at 1/N of its memory")
    parser.add_argument("--cpus", type=int, default=int(trial["cpus_per_trial"]), help="torch threads per process")
    add_training_arguments(parser, 50, "process")
    args = parser.parse_args(argv)
    if args.processes < 1 or args.cpus < 1:
        parser.error("--processes and --cpus must be at least 1")
    common, steps, warmup = training_run(parser, args)
    overrides = [*common, *VARIANT]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU: CPU processes"

    print(f"{device}; preset {args.preset}; {steps} timed steps per process; {args.cpus} threads each")
    print(f"{'phase':<8} {'processes':>9} {'memory cap':>10} {'tokens/s':>10} {'vs alone':>9} {'start-up':>9}",
          flush=True)
    alone = run_phase(1, 0.0, args.cpus, overrides, warmup, steps)
    print(phase_row("alone", alone, "none", alone), flush=True)
    shared = run_phase(args.processes, 1 / args.processes, args.cpus, overrides, warmup, steps)
    print(phase_row("shared", shared, f"{1 / args.processes:.2f}", alone), flush=True)
    per_process = [r["tokens"] / (r["end"] - r["start"]) for r in shared["processes"]]
    print("shared, each process's own tokens/s: " + ", ".join(f"{t:.0f}" for t in per_process))
    print("threads per process: " + ", ".join(str(r["threads"]) for r in alone["processes"] + shared["processes"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
