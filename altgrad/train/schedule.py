"""Learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio * lr`."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """nanoGPT's schedule as a pure function of the step (so resume needs no scheduler state)."""
    min_lr = lr * min_lr_ratio
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    progress = (step - warmup_steps) / max(1, max_steps - 1 - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (lr - min_lr)
