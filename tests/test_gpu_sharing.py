"""benchmarks/gpu_sharing.py in its smoke mode, on CPU processes: N trainer processes started
together, each capped as a sweep trial is, against one alone. (On a GPU it is item 5's measurement;
here it must run, count what each process trained and report the aggregate against the one alone.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from compiled_steps import TINY

from altgrad.tune.config import SWEEP_PRESETS

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_sharing_benchmark_reports_the_aggregate_against_one_process_alone():
    sets = [arg for s in TINY for arg in ("--set", s)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's own default: all cores
    env["ALTGRAD_NO_COMPILE"] = "1"  # the cpu preset: nothing to compile anyway
    launched = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(BENCH / "gpu_sharing.py"), "--smoke", "--processes", "2",
                             "--preset", "cpu", *sets], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = []
    while not lines or not lines[-1].startswith("alone"):
        line = proc.stdout.readline()
        assert line, f"the benchmark ended before it reported the process alone: {lines}"
        lines.append(line)
    alone_reported = time.monotonic()
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait() == 0
    ended = time.monotonic()
    wall = ended - launched
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["alone"], ["shared"])}
    assert rows["alone"][1:3] == ["1", "none"] and rows["shared"][1:3] == ["2", "0.50"]
    alone, shared = float(rows["alone"][3]), float(rows["shared"][3])
    ratio = float(rows["shared"][4].rstrip("x"))  # to 0.01, of tokens/s printed to 1
    assert (shared - 0.5) / (alone + 0.5) - 0.005 <= ratio <= (shared + 0.5) / (alone - 0.5) + 0.005
    # start-up: from a phase's launch to its first timed step; both phases' lie within the run
    startups = [float(rows[name][5].rstrip("s")) for name in ("alone", "shared")]
    assert all(s > 0 for s in startups) and sum(startups) < wall
    # the process alone is reported as soon as its phase ends, before the shared phase starts up: a
    # run cut short there (compiling, on a GPU lease) still says what one process does alone
    assert ended - alone_reported > startups[1]
    each = [float(t) for t in out.split("own tokens/s: ")[1].splitlines()[0].split(", ")]
    # the aggregate is over the wall time from the first timed step to the last, which spans each
    # process's own: at most the sum of their rates, and (started together) at least the slowest's
    assert len(each) == 2 and min(each) - 1 <= shared <= sum(each) + 1  # (each printed to 1)
    threads = [int(t) for t in out.split("threads per process: ")[1].splitlines()[0].split(", ")]
    assert threads == [SWEEP_PRESETS["gpu"]["cpus_per_trial"]] * 3  # uncapped: os.cpu_count() each
