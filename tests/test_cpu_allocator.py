"""The CPU allocator setting: a freed 100 MB tensor's pages are reused, not faulted in again."""

import subprocess
import sys

SCRIPT = """
import resource, sys, torch
from altgrad.train.cpu_allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def faults_of_a_fresh_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(25_000_000)  # 100 MB, written, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_fresh_tensor()
print(min(faults_of_a_fresh_tensor() for _ in range(3)))
"""


def page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_retained_memory_is_reused_without_page_faults():
    pages = 100_000_000 // 4096
    assert page_faults("default") > pages // 2  # glibc mmaps it afresh every time
    assert page_faults("retain") < pages // 100
