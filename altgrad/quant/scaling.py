"""Per-tensor scaling: quantize(x * s) / s with s = fmt.max / (amax * 2^margin).

A power-of-two s (the default, rounded down) makes x * s and q / s exact, so scaling changes which
values are representable but never adds rounding of its own. Everything here stays on the device:
no `.item()`, no Python branches on tensor values, so a training step never waits on the host.
A zero or non-finite amax keeps the previous scale, and a non-finite amax is not recorded, so one
bad step cannot poison the history.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from altgrad.quant.formats import FormatSpec, get_format

ScalingMode = Literal["none", "dynamic", "delayed"]
AmaxAlgo = Literal["max", "most_recent"]


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """0-dim float32 max |x| (NaN if any element is NaN): one `aminmax` pass and no |x| temporary,
    2x faster than abs().amax() on CPU (and 5x faster than vector_norm(x, inf))."""
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(-lo, hi).float()


def compute_scale(amax: torch.Tensor, fmt: str | FormatSpec, margin: float = 0, pow2: bool = True,
                  prev_scale: torch.Tensor | None = None) -> torch.Tensor:
    """0-dim float32 s = fmt.max / (amax * 2^margin), rounded down to a power of two if `pow2`.

    Where that is not a positive finite (normal) float -- amax zero, inf, NaN or so small that s
    overflows -- the result is `prev_scale` (1 when None).
    """
    fmt = get_format(fmt)
    amax = torch.as_tensor(amax).detach().to(torch.float32)
    target = torch.full_like(amax, fmt.max * 2.0**-margin)
    s = target / amax
    if pow2:  # keep sign and exponent bits: 2^floor(log2 s); a subnormal s becomes 0 (rejected)
        s = (s.view(torch.int32) & -0x800000).view(torch.float32)
        # s was rounded before flooring: if it rounded up onto a power of two, step back down
        s = torch.where(amax * s > target, s * 0.5, s)
    prev = torch.ones_like(s) if prev_scale is None else prev_scale.detach().to(s)
    ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(s) & (s >= torch.finfo(s.dtype).tiny)
    return torch.where(ok, s, prev)


class AmaxHistory(nn.Module):
    """A rolling window of per-step amax values, oldest first, kept in a checkpointed buffer."""

    def __init__(self, history_len: int = 16, algo: AmaxAlgo = "max"):
        super().__init__()
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
        self.algo = algo
        self.register_buffer("amax_history", torch.zeros(history_len))

    def record(self, amax: torch.Tensor) -> None:
        """Append one amax, dropping the oldest; a non-finite amax leaves the window unchanged."""
        amax = amax.detach().to(self.amax_history).reshape(1)
        rolled = torch.cat([self.amax_history[1:], amax])
        self.amax_history.copy_(torch.where(torch.isfinite(amax), rolled, self.amax_history))

    def estimate(self) -> torch.Tensor:
        """The amax to scale by: the window's maximum, or its most recent entry."""
        return self.amax_history.max() if self.algo == "max" else self.amax_history[-1]

    def extra_repr(self) -> str:
        return f"history_len={self.amax_history.numel()}, algo={self.algo!r}"


class TensorScaler(AmaxHistory):
    """The scale of one tensor role (an input, a weight, a gradient) from step to step.

    Modes: 'none' (s = 1, the raw format range), 'dynamic' (from this tensor's amax), 'delayed'
    (from the amax history *before* this tensor, the usual FP8 recipe; while the history holds no
    positive amax yet, e.g. on the first step, the current amax is used). Buffers: `amax_history`,
    `scale` (last returned) and `amax` (of the last tensor seen, raw, for diagnostics).
    """

    def __init__(self, fmt: str | FormatSpec, mode: ScalingMode = "delayed", history_len: int = 16,
                 algo: AmaxAlgo = "max", margin: float = 0, pow2: bool = True):
        super().__init__(history_len, algo)
        if mode not in ("none", "dynamic", "delayed"):
            raise ValueError(f"mode must be 'none', 'dynamic' or 'delayed', got {mode!r}")
        self.fmt, self.mode, self.margin, self.pow2 = get_format(fmt), mode, margin, pow2
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("amax", torch.zeros(()))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> torch.Tensor:
        """Record amax(x) and return the 0-dim scale to quantize x with this step."""
        amax = abs_max(x) if x.numel() else torch.zeros_like(self.amax)
        if self.mode == "none":
            s = torch.ones_like(self.scale)
        else:
            if self.mode == "delayed":
                past = self.estimate()
                amax_for_scale = torch.where(past > 0, past, amax)
            else:
                amax_for_scale = amax
            s = compute_scale(amax_for_scale, self.fmt, self.margin, self.pow2, self.scale)
        self.amax.copy_(amax)
        self.record(amax)
        self.scale.copy_(s)
        return s

    @torch.no_grad()
    def current(self, x: torch.Tensor) -> torch.Tensor:
        """The scale to quantize x with, leaving the state alone (evaluation): the stored scale,
        or for 'dynamic' the one from x's own amax."""
        if self.mode == "dynamic":
            return compute_scale(abs_max(x), self.fmt, self.margin, self.pow2, self.scale)
        return self.scale

    def extra_repr(self) -> str:
        return (f"fmt={self.fmt.name}, mode={self.mode!r}, {super().extra_repr()}, "
                f"margin={self.margin}, pow2={self.pow2}")
