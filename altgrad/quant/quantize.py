"""The exact quantizer: round a float tensor onto a `FormatSpec`'s grid and back.

The public API: `quantize`, `fake_quantize` (with the straight-through gradient) and
`rounding_noise`. How the rounding is exact, and how its kernels compile, is in
`altgrad.quant.kernels`.

Inputs are computed in float32 (float64 stays float64, so there is no double rounding); bf16/fp16
are widened exactly. Results are cast back to the input dtype: every 8-bit value fits bf16, but
fp16 cannot hold e6m1/e7m0's range. A scale s means quantize(x * s) / s in that precision.
"""

from __future__ import annotations

from typing import Literal

import torch

from altgrad.quant.formats import FormatSpec, get_format
from altgrad.quant.kernels import (
    Kernel,
    Scale,
    container_dtype,
    family,
    grid_params,
    nearest,
    nearest_scaled,
    scale_tensor,
    stochastic,
)

Rounding = Literal["nearest", "stochastic"]

_NEAREST = Kernel(nearest)
_NEAREST_SCALED = Kernel(nearest_scaled)
_STOCHASTIC = Kernel(stochastic)


def rounding_noise(flat: torch.Tensor, rounding: Rounding,
                   generator: torch.Generator | None = None) -> torch.Tensor | None:
    """U[0, 1) per element of `flat` for stochastic rounding (container dtype), None for nearest."""
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "nearest":
        return None
    return torch.rand(flat.shape, generator=generator, dtype=container_dtype(flat.dtype), device=flat.device)


def quantize(x: torch.Tensor, fmt: str | FormatSpec, scale: Scale = None,
             rounding: Rounding = "nearest", saturate: bool = True,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Round x onto fmt's grid and return the (dequantized) values, same dtype and shape.

    With `scale` s: quantize(x * s) / s. `saturate=False` lets overflow become inf ('ieee') or NaN
    ('fn'); 'none' formats have neither and always saturate. Stochastic rounding takes
    floor(|t| + U), U ~ U[0, 1) from `generator`, with t = |x * s| / ULP: unbiased up to float
    rounding of t + U. Not differentiable (see `fake_quantize`).
    """
    fmt = get_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    dtype = container_dtype(x.dtype)
    p = grid_params(fmt, bool(saturate), dtype, x.device)
    (m0, ftz), flat = family(fmt), x.reshape(-1).detach()  # detach last: no `_base` for dynamo to guard on
    noise = rounding_noise(flat, rounding, generator)
    with torch.no_grad():
        if noise is not None:
            out = _STOCHASTIC(flat, scale_tensor(scale, dtype, x.device), p, ftz, noise)
        elif scale is None:
            out = _NEAREST(flat, p, m0, ftz)
        else:
            out = _NEAREST_SCALED(flat, scale_tensor(scale, dtype, x.device), p, m0, ftz)
    return out.view(x.shape)


class _StraightThrough(torch.autograd.Function):
    """Forward returns q = quantize(x); backward passes the gradient to x unchanged (STE), or, with
    `clip_ste`, zeroed where |x * s| > fmt.max, i.e. where the forward saturated."""

    @staticmethod
    def forward(ctx, x, quantized, fmt, scale, clip_ste):
        # quantized = (q,): inside a tuple q is not an input of the Function, so q itself becomes
        # the output (a view of an input would be, and autograd refuses in-place ops on those).
        ctx.fmt, ctx.clip_ste = fmt, clip_ste
        if clip_ste:
            ctx.save_for_backward(x, scale if isinstance(scale, torch.Tensor) else None)
            ctx.py_scale = None if isinstance(scale, torch.Tensor) else scale
        return quantized[0]

    @staticmethod
    def backward(ctx, grad):
        if ctx.clip_ste:
            x, tscale = ctx.saved_tensors
            scale = tscale if tscale is not None else ctx.py_scale
            y = x.to(container_dtype(x.dtype))
            if scale is not None:
                y = y * scale
            grad = grad.masked_fill(y.abs() > ctx.fmt.max, 0)
        return grad, None, None, None, None


def straight_through(x: torch.Tensor, q: torch.Tensor, fmt: FormatSpec, scale: Scale = None,
                     clip_ste: bool = False) -> torch.Tensor:
    """q (already quantize(x, fmt, scale)) in forward, x's gradient in backward: the STE."""
    return _StraightThrough.apply(x, (q.detach(),), fmt, scale, clip_ste)


def fake_quantize(x: torch.Tensor, fmt: str | FormatSpec, scale: Scale = None,
                  rounding: Rounding = "nearest", clip_ste: bool = False,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """quantize() in forward, identity gradient in backward (STE).

    With `clip_ste` the gradient is zeroed where |x * s| > fmt.max, i.e. where the forward
    saturated, as in PACT/LSQ-style clipped estimators.
    """
    fmt = get_format(fmt)
    return straight_through(x, quantize(x, fmt, scale, rounding, generator=generator), fmt, scale, clip_ste)
