"""The CPU allocator setting: a freed 100 MB tensor's pages are reused, not faulted in again -- in
a process that applied it, and in one that ran `benchmarks/quantize.py`, whose ratios would
otherwise time the allocator rather than the kernels (docs/design.md)."""

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
PAGES = 100_000_000 // 4096  # of the fresh tensor

# argv[1]: "default" (glibc's setting), "retain" (the trainer's call) or "quantize-benchmark" (the
# benchmark's smoke run, which must leave the trainer's setting); then the fewest page faults of a
# fresh 100 MB tensor over ROUNDS made and freed one after another. Under the trainer's setting the
# heap takes a few rounds to settle: posix_memalign asks for more than the chunk a freed tensor
# left, so until that chunk coalesces with its neighbours the heap grows instead (how many rounds:
# docs/design.md). Under glibc's default every round maps fresh pages, however many there are.
ROUNDS = 12
SCRIPT = f"""
import resource, sys, torch
from altgrad.train.cpu_allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
if sys.argv[1] == "quantize-benchmark":
    sys.path.insert(0, {str(BENCH)!r})
    import quantize
    quantize.main(["--smoke"])
def faults_of_a_fresh_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(25_000_000)  # 100 MB, written, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(min(faults_of_a_fresh_tensor() for _ in range({ROUNDS})))
"""


def page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, "ALTGRAD_NO_COMPILE": "1"})  # (the benchmark's kernels: eager)
    return int(out.stdout.split()[-1])


def test_retained_memory_is_reused_without_page_faults():
    assert page_faults("default") > PAGES // 2  # glibc mmaps it afresh every time
    assert page_faults("retain") < PAGES // 100


def test_the_quantize_benchmark_allocates_as_a_training_run_does():
    assert page_faults("quantize-benchmark") < PAGES // 100
