"""The FP32 shadow: how far the quantized model's gradients point from full precision's.

A float32 copy of the model, synced from the master weights, runs the same batch with its own
backward; the per-layer cosine between its weight gradients and the quantized model's says how
much the formats bend the descent direction. Its gradients are dropped after every comparison.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from altgrad.metrics import SHADOW_COS, SHADOW_COS_MEAN, SHADOW_COS_MIN
from altgrad.model import GPT, GPTConfig, batch_loss
from altgrad.quant.convert import linear_layers
from altgrad.train.diagnostics import Metrics, layer_metric_names, short_name


class FP32Shadow:
    def __init__(self, model_cfg: GPTConfig, device: torch.device):
        self.model = GPT(model_cfg).to(device=device, dtype=torch.float32)
        self.layers = linear_layers(self.model)
        self.names = tuple(short_name(n) for n in self.layers)

    @torch.no_grad()
    def _sync(self, master: nn.Module) -> None:
        params = dict(master.named_parameters())
        for name, p in self.model.named_parameters():
            p.copy_(params[name])

    def cosines(self, master: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Metrics:
        """Per-layer cosine(grad_quantized, grad_fp32); call after the master's backward."""
        self._sync(master)
        self.model.train(master.training)
        batch_loss(self.model, x, y).backward()
        # In float64: summed in float32 over the tied head's millions of elements, the cosine of a
        # gradient with itself came out 1.00003, an error as large as what the formats' cosines
        # differ by (0.994 against 0.998); rounded back to float32 it is exact.
        cos = torch.stack([F.cosine_similarity(master.get_submodule(name).weight.grad.detach().double().flatten(),
                                               self.model.get_submodule(name).weight.grad.double().flatten(), dim=0)
                           for name in self.layers]).float()
        self.model.zero_grad(set_to_none=True)
        return {layer_metric_names(SHADOW_COS, self.names): cos, SHADOW_COS_MEAN: cos.mean(), SHADOW_COS_MIN: cos.min()}
