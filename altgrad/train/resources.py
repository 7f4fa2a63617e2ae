"""A trainer process's share of the machine: its CPU threads and its slice of the GPU's memory.

A sweep runs several trials on one GPU (`gpu_fraction` 0.25: four at once). Each is a process of
its own, so nothing but this cap keeps one trial's allocator from taking the memory the others
need. Ray-free, so the GPU-sharing benchmark caps its processes the same way.
"""

from __future__ import annotations

import torch


def limit_resources(cpus: int, gpu_fraction: float) -> None:
    """No oversubscription: torch uses the process's `cpus` cores and at most `gpu_fraction` of the
    GPU's memory (0: no cap)."""
    torch.set_num_threads(cpus)
    if gpu_fraction > 0 and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(min(gpu_fraction, 1.0))
