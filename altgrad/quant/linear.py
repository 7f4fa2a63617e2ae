"""`QuantizedLinear`: an `nn.Linear` that fake-quantizes its input, weight and grad_output.

Built by `from_float`, which reuses the original Parameters (weight tying and optimizer state
survive the swap). Each of the three tensors has its own format and `TensorScaler`, so a
delayed-scaling history is kept per tensor and checkpointed with the model's state_dict.

Diagnostics (overflow / underflow counts and a 256-bin code histogram per tensor) are collected
only while `collect_stats` is on, into on-device buffers the trainer reads in its one host sync;
tensors larger than STATS_SAMPLE elements are counted on an evenly spread sample.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from altgrad.quant.codes import quantizer_counts
from altgrad.quant.formats import FormatSpec
from altgrad.quant.quantize import fake_quantize, quantize
from altgrad.quant.scaling import TensorScaler

ROLES = ("input", "weight", "grad_output")
STATS_SAMPLE = 1 << 16
STATS_RUNS = 64


def _sample(x: torch.Tensor) -> torch.Tensor:
    """x itself up to STATS_SAMPLE elements, else STATS_RUNS evenly spaced contiguous runs (a view)."""
    flat = x.detach().reshape(-1)
    if flat.numel() <= STATS_SAMPLE:
        return flat
    period = flat.numel() // STATS_RUNS
    return flat[:STATS_RUNS * period].view(STATS_RUNS, period)[:, :STATS_SAMPLE // STATS_RUNS]


@dataclass(frozen=True)
class ScalingPolicy:
    mode: str = "delayed"
    history_len: int = 16
    algo: str = "max"
    margin: int = 0
    pow2: bool = True


@dataclass(frozen=True)
class LinearQuantPolicy:
    """Formats of one layer's three quantized tensors, and how they are scaled and rounded."""

    input: FormatSpec
    weight: FormatSpec
    grad_output: FormatSpec
    scaling: ScalingPolicy = ScalingPolicy()
    rounding: str = "nearest"
    clip_ste: bool = False

    def format_of(self, role: str) -> FormatSpec:
        return getattr(self, role)


class TensorStats(nn.Module):
    """On-device counters for one quantized tensor: overflow, underflow, elements, histogram."""

    def __init__(self):
        super().__init__()
        self.register_buffer("counts", torch.zeros(3), persistent=False)  # overflow, underflow, n
        self.register_buffer("histogram", torch.zeros(256), persistent=False)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, q: torch.Tensor, fmt: FormatSpec, scale: torch.Tensor) -> None:
        """Count overflow (|x * s| > max, inf included: it saturates), underflow (x != 0 that
        quantized to 0) and the codes, over a sample of at most STATS_SAMPLE elements.

        Tensors up to that size are counted exactly; larger ones (the logits gradient has
        B * T * vocab elements) on STATS_RUNS evenly spaced runs of contiguous elements, which
        estimates the rates without bias for a fraction of the cost (contiguous runs, not a
        stride: one element per cache line over 100 MB costs more than counting them all).
        """
        x, q = _sample(x), _sample(q)
        counts, codes = quantizer_counts(x, q, fmt, scale)
        self.counts[:2] += counts
        self.counts[2] += x.numel()
        self.histogram += torch.bincount(codes, minlength=256)

    def reset(self) -> None:
        self.counts.zero_()
        self.histogram.zero_()


class _QuantizeGradOutput(torch.autograd.Function):
    """Identity forward; quantizes the incoming gradient in backward (the 'hybrid' recipe)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.layer._quantize("grad_output", grad, ste=False), None


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
        s = policy.scaling
        self.scalers = nn.ModuleDict(
            {
                role: TensorScaler(policy.format_of(role), s.mode, s.history_len, s.algo, s.margin, s.pow2)
                for role in ROLES
            }
        ).to(device)
        self.stats = nn.ModuleDict({role: TensorStats() for role in ROLES}).to(device)

    def set_format(self, role: str, fmt: FormatSpec) -> None:
        """Move one tensor to another format (the emergency mantissa shift)."""
        self.policy = replace(self.policy, **{role: fmt})
        self.scalers[role].fmt = fmt

    def _quantize(self, role: str, x: torch.Tensor, ste: bool = True) -> torch.Tensor:
        fmt = self.policy.format_of(role)
        scale = self._scale(role, x)
        if ste:
            q = fake_quantize(x, fmt, scale, rounding=self.policy.rounding, clip_ste=self.policy.clip_ste)
        else:
            q = quantize(x, fmt, scale, rounding=self.policy.rounding)
        if self.collect_stats:
            self.stats[role].observe(x, q, fmt, scale)
        return q

    def _scale(self, role: str, x: torch.Tensor) -> torch.Tensor:
        """Training steps advance the scaling state; evaluation only reads it."""
        scaler = self.scalers[role]
        return scaler.update(x) if self.training else scaler.current(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self._quantize("input", x), self._quantize("weight", self.weight), self.bias)
        if torch.is_grad_enabled() and y.requires_grad:
            y = _QuantizeGradOutput.apply(y, self)
        return y

    def extra_repr(self) -> str:
        p = self.policy
        return (
            f"{super().extra_repr()}, input={p.input.name}, weight={p.weight.name}, "
            f"grad_output={p.grad_output.name}, scaling={p.scaling.mode}"
        )
