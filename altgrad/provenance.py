"""Which code produced a number: the git commit a sweep or a benchmark ran, for the results that
cite it (sweep.json, benchmarks/results/, the README)."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What "the code" is: files whose changes can change a result. Results files and the README that
# runs rewrite are not, so publishing a run does not make the next one `+dirty`.
CODE = ("altgrad", "benchmarks", "sweeps", "pyproject.toml", ":!benchmarks/results")


def source_commit() -> str | None:
    """The checkout's short commit, `+dirty` when its code differs from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


@cache
def process_commit() -> str | None:
    """`source_commit` as this process first asked, kept for its life: a process runs the code it
    imported, whatever the checkout holds later (a sweep's driver or a trial's worker that outlives
    a commit). Ask early: a sweep's driver as it starts, a trial's worker as its first trial does
    (Tune reuses the worker for later trials)."""
    return source_commit()
