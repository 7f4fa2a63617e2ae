"""Keep freed host memory in the process, so a CPU training step stops paying for page faults.

glibc serves every allocation above its mmap threshold (at most 32 MB by default) with a fresh
`mmap`, and gives it back with `munmap` when freed. A step on the cpu preset allocates and frees
several ~100 MB tensors (the logits over the 50k vocabulary, their softmax and gradient), so every
step faults in and zeroes hundreds of MB of new pages (what that cost: docs/design.md). Raising the
mmap and trim thresholds makes those blocks come from, and return to, the heap, where the next step
reuses them. The cost is that the process keeps its peak memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30

_applied = False


def retain_freed_memory() -> bool:
    """Tune glibc malloc once per process (a no-op elsewhere); True when the setting took."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    _applied = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD))
    return _applied
