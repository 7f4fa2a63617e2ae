"""Partition-relative gradient clipping (SPEC §6): one outlier cannot blow up a layer's grad scale.

Each quantized layer's weight gradient is clamped elementwise to ±k × the maximum of its own
gradient-amax history (nothing is clipped while the history is still empty); the amax recorded is
the one after clipping. Histories are buffers of this module, checkpointed by the trainer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from altgrad.quant.linear import QuantizedLinear
from altgrad.quant.scaling import AmaxHistory


class PartitionClipper(nn.Module):
    def __init__(self, layers: dict[str, QuantizedLinear], k: float, history_len: int):
        super().__init__()
        self.k = k
        self.weights = [layer.weight for layer in layers.values()]
        self.histories = nn.ModuleList(AmaxHistory(history_len) for _ in self.weights)
        self.to(self.weights[0].device if self.weights else "cpu")

    @torch.no_grad()
    def clip_(self) -> None:
        for w, history in zip(self.weights, self.histories, strict=True):
            if w.grad is None:
                continue
            limit = self.k * history.amax_history.max()
            limit = torch.where(limit > 0, limit, math.inf)
            w.grad.clamp_(-limit, limit)
            history.record(w.grad.abs().amax())
