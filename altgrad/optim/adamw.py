"""AdamW over fp32 master weights, with nanoGPT's decay / no-decay parameter split.

The fused implementation honours `found_inf` (as set by AMP's GradScaler): the trainer uses it
to skip a non-finite step on the device, without a host round trip.
"""

from __future__ import annotations

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (Linear / Embedding weights), not biases or LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_adamw(model: nn.Module, cfg) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=True,
    )
