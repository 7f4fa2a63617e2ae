"""Time to a trial's first step: cold, warm on the same machine, and warm from the experiment's cache.

A sweep trial is a fresh process that compiles its step graph before its first step. Each phase
below is such a process, building the host-bound proxy's e4m3 trainer (the gpu preset's compiled
step graph, at a size this CPU compiles as fast as any) and timing construction plus the first step:

    cold            an empty inductor cache: everything is compiled (the baseline); the process
                    then saves its cache artifacts, as a trial does (`altgrad.tune.compile_cache`)
    warm, same disk the same inductor cache directory: a later trial on the same machine
    warm, artifacts an empty inductor cache plus the saved artifacts loaded: a trial on another
                    node, or on the machine that replaced a killed spot instance

    python benchmarks/warm_trial.py [--record [DIR]]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import Claim, add_record_argument, write

OVERRIDES = ["quant.format=e4m3", "train.diag_every=0", "train.shadow_every=0"]
PHASES = ("cold", "warm, same disk", "warm, artifacts")
TARGETS = {"warm, same disk": 0.5, "warm, artifacts": 0.5}  # of the cold time to first step


def first_step(workdir: Path, cache: Path, load: bool, save: bool) -> float:
    """In this process (its inductor cache set by the caller): load the artifacts in `cache` if
    `load`, build the trainer and take its first step, save the artifacts if `save`; the seconds
    from building to the end of the first step."""
    from pyarrow.fs import LocalFileSystem
    from train_step import BENCH_PRESETS, build

    from altgrad.tune import compile_cache

    fs = LocalFileSystem()
    start = time.perf_counter()
    if load:
        compile_cache.load(fs, str(cache))
    preset, bundle = BENCH_PRESETS["host"]
    trainer = build([f"preset={preset}", *bundle, *OVERRIDES], 10, workdir)
    trainer.train_step(2)  # step 1 would evaluate
    seconds = time.perf_counter() - start
    if save:
        compile_cache.save(fs, str(cache), "trial")
    return seconds


def run_phase(phase: str, inductor_dir: Path, cache: Path, workdir: Path) -> float:
    """`phase` in a fresh process with TORCHINDUCTOR_CACHE_DIR=inductor_dir."""
    args = [sys.executable, __file__, "--phase", phase, "--cache", str(cache), "--workdir", str(workdir)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    if args.phase:
        seconds = first_step(args.workdir, args.cache, load=args.phase == "warm, artifacts",
                             save=args.phase == "cold")
        print(json.dumps({"seconds": seconds}))
        return

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        disk, fresh, cache = tmp / "inductor", tmp / "inductor-fresh", tmp / "compile_cache"
        seconds = {phase: run_phase(phase, fresh if phase == "warm, artifacts" else disk, cache, tmp / str(i))
                   for i, phase in enumerate(PHASES)}
        saved = sum(f.stat().st_size for f in cache.iterdir())
    cold = seconds["cold"]
    print(f"{'phase':<16} {'first step':>11} {'vs cold':>8}")
    for phase, s in seconds.items():
        print(f"{phase:<16} {s:>10.1f}s {s / cold:>7.2f}x")
    print(f"saved artifacts: {saved / 1e6:.1f} MB")
    if args.record:
        claims = [Claim(f"first step, {phase}", seconds[phase] / cold, "first step, cold", target,
                        f"{seconds[phase]:.1f} vs {cold:.1f} s; artifacts {saved / 1e6:.1f} MB")
                  for phase, target in TARGETS.items()]
        print(f"recorded in {write('warm_trial', claims, args.record)}")


if __name__ == "__main__":
    main()
