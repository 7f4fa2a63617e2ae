"""Time to a trial's first step: cold, warm on the same machine, and warm from the experiment's cache.

A sweep trial is a fresh process that compiles its step graph before its first step. Each phase
below is such a process, building the host-bound proxy's e4m3 trainer (the gpu preset's compiled
step graph, at a size this CPU compiles as fast as any) and timing construction plus the first step:

    cold            the experiment's compile cache empty: everything is compiled (the baseline)
    warm, same node the cache as the cold trial left it, in place, on the cold trial's node (its
                    temp dir): a later trial on local storage
    warm, new node  the cache on another filesystem, fetched into an empty node directory first
                    (as from S3), on a node of its own: a trial on another node, or on the machine
                    that replaced a killed spot instance

Each trial process uses the cache as a sweep trial does (`altgrad.tune.compile_cache`).

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
from typing import Any

from pyarrow.fs import LocalFileSystem, SubTreeFileSystem
from record import Claim, add_record_argument, write

OVERRIDES = ["quant.format=e4m3", "train.diag_every=0", "train.shadow_every=0"]
PHASES = ("cold", "warm, same node", "warm, new node")
TARGETS = {"warm, same node": 0.5, "warm, new node": 0.5}  # of the cold time to first step


class OtherNode(SubTreeFileSystem):
    """The experiment's storage as another node sees a remote store: not 'local', so a trial
    fetches the cache into a node directory (its own TMPDIR) and publishes it back."""

    @property
    def type_name(self) -> str:
        return "other-node"


def first_step(workdir: Path, cache: str, remote: bool) -> float:
    """In this process: use the compile cache `cache` (on another node's view of the storage if
    `remote`), build the trainer, take its first step and publish the cache; the seconds from
    using the cache to the end of the first step."""
    from train_step import BENCH_PRESETS, build

    from altgrad.tune.compile_cache import CompileCache

    compile_cache = CompileCache(OtherNode("/", LocalFileSystem()) if remote else LocalFileSystem(), cache)
    start = time.perf_counter()
    compile_cache.use()
    preset, bundle = BENCH_PRESETS["host"]
    trainer = build([f"preset={preset}", *bundle, *OVERRIDES], 10, workdir)
    trainer.train_step(2)  # step 1 would evaluate
    seconds = time.perf_counter() - start
    compile_cache.publish()
    return seconds


def trial_output(script: str, flags: list[str], cache: Path, workdir: Path, node: Path) -> dict[str, Any]:
    """`script` run as a trial's child process (`flags`, its cache and work dir) on `node`, its temp
    dir: where inductor keeps what it keeps per machine (its precompiled headers: docs/design.md,
    "Inductor's precompiled headers"). The JSON object it printed last."""
    args = [sys.executable, script, *flags, "--cache", str(cache), "--workdir", str(workdir)]
    node.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(args, env={**os.environ, "TMPDIR": str(node)}, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def trial_seconds(script: str, flags: list[str], cache: Path, workdir: Path, node: Path) -> float:
    """The seconds `trial_output` printed."""
    return trial_output(script, flags, cache, workdir, node)["seconds"]


def parse_trial_arguments(argv: list[str] | None, doc: str, child: str, choices: tuple[str, ...],
                          repeat: tuple[int, str] | None = None) -> argparse.Namespace:
    """A trial benchmark's command line: `--record`, and `--repeat` where given (its default and
    help); a child process gets `--<child>` (one of `choices`), its compile cache and work dir."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if repeat:
        parser.add_argument("--repeat", type=int, default=repeat[0], help=repeat[1])
    parser.add_argument(f"--{child}", choices=choices, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    add_record_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_trial_arguments(argv, __doc__, "phase", PHASES)
    if args.phase:
        seconds = first_step(args.workdir / "run", str(args.cache), remote=args.phase == "warm, new node")
        print(json.dumps({"seconds": seconds}))
        return

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "experiment" / "compile_cache"
        seconds = {phase: trial_seconds(__file__, ["--phase", phase], cache, tmp / str(i),
                                         tmp / ("new-node" if phase == "warm, new node" else "node"))
                   for i, phase in enumerate(PHASES)}
        saved = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    cold = seconds["cold"]
    print(f"{'phase':<16} {'first step':>11} {'vs cold':>8}")
    for phase, s in seconds.items():
        print(f"{phase:<16} {s:>10.1f}s {s / cold:>7.2f}x")
    print(f"compile cache: {saved / 1e6:.1f} MB")
    if args.record:
        claims = [Claim(f"first step, {phase}", seconds[phase] / cold, "first step, cold", target,
                        f"{seconds[phase]:.1f} vs {cold:.1f} s; cache {saved / 1e6:.1f} MB")
                  for phase, target in TARGETS.items()]
        print(f"recorded in {write('warm_trial', claims, args.record)}")


if __name__ == "__main__":
    main()
