"""Optimizer registry: the grid's optimizer axis accepts whatever `OPTIMIZERS` holds."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from altgrad.optim.adamw import build_adamw
from altgrad.optim.manifold import build_manifold

OptimizerBuilder = Callable[[nn.Module, "OptimConfig"], torch.optim.Optimizer]  # noqa: F821

OPTIMIZERS: dict[str, OptimizerBuilder] = {
    "adamw": build_adamw,
    "manifold": build_manifold,
}


def build_optimizer(name: str, model: nn.Module, cfg) -> torch.optim.Optimizer:
    """Build the optimizer `name` for `model` from an `OptimConfig`."""
    try:
        builder = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}") from None
    return builder(model, cfg)
