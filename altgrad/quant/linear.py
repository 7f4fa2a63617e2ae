"""`QuantizedLinear`: an `nn.Linear` that fake-quantizes its input, weight and grad_output.

Built by `from_float`, which reuses the original Parameters (weight tying and optimizer state
survive the swap). Each of the three tensors has its own format and `TensorScaler`, so a
delayed-scaling history is kept per tensor and checkpointed with the model's state_dict. A role the
policy leaves out (`LinearQuantPolicy.quantized`) passes its tensor through untouched: its scaler
keeps its initial state and its counters stay empty, but both exist, so every layer has the same
state_dict and the same probes whatever its roles.

Diagnostics (overflow / underflow counts and a 256-bin code histogram per tensor) are collected
only while `collect_stats` is on, into on-device buffers the trainer reads in its one host sync;
tensors larger than `step.STATS_SAMPLE` elements are counted on a stratified sample (`step.sample`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from altgrad.quant.formats import FormatSpec
from altgrad.quant.quantize import quantize, straight_through
from altgrad.quant.scaling import TensorScaler
from altgrad.quant.step import TensorStats, quantize_step
from altgrad.scaling_policy import ScalingPolicy

ROLES = ("input", "weight", "grad_output")
K = TypeVar("K")


@dataclass(frozen=True)
class LinearQuantPolicy:
    """Formats of one layer's three tensors, which of them are quantized, and how they are scaled
    and rounded. `grad_scaling` scales grad_output on its own (None: like the others, `scaling`):
    gradients span a wider, shifting range, and whether a format survives them unscaled is one of
    the research questions."""

    input: FormatSpec
    weight: FormatSpec
    grad_output: FormatSpec
    scaling: ScalingPolicy = ScalingPolicy()
    grad_scaling: ScalingPolicy | None = None
    rounding: str = "nearest"
    clip_ste: bool = False
    quantized: tuple[str, ...] = ROLES

    def __post_init__(self) -> None:
        unknown = sorted(set(self.quantized) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown quantized role(s) {unknown}; roles are {list(ROLES)}")

    def format_of(self, role: str) -> FormatSpec:
        return getattr(self, role)

    def scaling_of(self, role: str) -> ScalingPolicy:
        if role == "grad_output" and self.grad_scaling is not None:
            return self.grad_scaling
        return self.scaling

    def quantizes(self, role: str) -> bool:
        return role in self.quantized


class _QuantizeGradOutput(torch.autograd.Function):
    """Identity forward; quantizes the incoming gradient in backward (the 'hybrid' recipe), counted
    when the forward was."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, layer: QuantizedLinear, count: bool) -> torch.Tensor:
        ctx.layer = layer
        ctx.count = count
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.layer._quantize("grad_output", grad, ste=False, count=ctx.count), None, None


class QuantizedLinear(nn.Linear):
    policy: LinearQuantPolicy

    @classmethod
    def from_float(cls, linear: nn.Linear, policy: LinearQuantPolicy) -> QuantizedLinear:
        """Swap-in replacement for `linear` that shares its weight and bias Parameters."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight = linear.weight
        new.bias = linear.bias
        new._setup(policy, device=linear.weight.device)
        return new

    def _setup(self, policy: LinearQuantPolicy, device: torch.device) -> None:
        self.policy = policy
        self.collect_stats = False
        self.scalers = nn.ModuleDict({role: TensorScaler(policy.format_of(role), policy.scaling_of(role))
                                      for role in ROLES}).to(device)
        self.stats = nn.ModuleDict({role: TensorStats() for role in ROLES}).to(device)

    @property
    def weight_scale(self) -> torch.Tensor:
        """The weight's current 0-dim scale (its scaler's buffer, updated in place)."""
        return self.scalers["weight"].scale

    def set_format(self, role: str, fmt: FormatSpec) -> None:
        """Move one tensor to another format (the emergency mantissa shift)."""
        self.policy = replace(self.policy, **{role: fmt})
        self.scalers[role].set_format(fmt)

    def _quantize(self, role: str, x: torch.Tensor, ste: bool = True, count: bool = False) -> torch.Tensor:
        """Training steps advance the scaling state (one fused kernel call); evaluation only reads it.
        A role the policy does not quantize returns x itself. With `count` the quantization is
        counted into the role's TensorStats."""
        if not self.policy.quantizes(role):
            return x
        fmt, rounding = self.policy.format_of(role), self.policy.rounding
        stats = self.stats[role] if count else None
        if self.training:
            q, scale = quantize_step(x, self.scalers[role], rounding, stats)
        else:
            scale = self.scalers[role].current(x)
            q = quantize(x, fmt, scale, rounding=rounding)
            if stats is not None:
                stats.observe(x, q, fmt, scale)
        return straight_through(x, q, fmt, scale, self.policy.clip_ste) if ste else q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = self.collect_stats
        y = F.linear(self._quantize("input", x, count=count), self._quantize("weight", self.weight, count=count),
                     self.bias)
        if self.policy.quantizes("grad_output") and torch.is_grad_enabled() and y.requires_grad:
            y = _QuantizeGradOutput.apply(y, self, count)
        return y

    def extra_repr(self) -> str:
        p = self.policy
        roles = ", ".join(f"{r}={p.format_of(r).name if p.quantizes(r) else 'off'}" for r in ROLES)
        grad = f", grad_scaling={p.grad_scaling.mode}" if p.grad_scaling is not None else ""
        return f"{super().extra_repr()}, {roles}, scaling={p.scaling.mode}{grad}"


def by_weight_format(layers: Mapping[K, QuantizedLinear]) -> dict[FormatSpec, list[K]]:
    """The keys of `layers` grouped by each layer's current weight format, for the kernels that run
    once per format over all its weights. Read it per step: an emergency shift changes formats."""
    groups: dict[FormatSpec, list[K]] = {}
    for key, layer in layers.items():
        groups.setdefault(layer.policy.weight, []).append(key)
    return groups
