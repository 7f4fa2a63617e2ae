"""Bit-stall: updates too small to move a weight's code, measured with the real quantizer.

An element stalls when its update is non-zero but Q(w + delta) == Q(w). This is not the same as
|delta| < ULP/2: at a binade edge the ULP below is half the ULP above, at the top the format
saturates, and ties go to the even code -- only the quantizer itself gets all of those right.
The training diagnostics count the same on device (`codes.code_moves`), where weights stored in
their format take Q to be the rounding that stored them, stochastic where the run says so.
All results are tensors on the input's device (no host sync).
"""

from __future__ import annotations

import torch

from altgrad.quant.formats import FormatSpec, get_format
from altgrad.quant.kernels import Scale, container_dtype, grid_params, scale_tensor, ulp
from altgrad.quant.quantize import quantize


def stiffness(w: torch.Tensor, fmt: str | FormatSpec, scale: Scale = None) -> torch.Tensor:
    """The ULP at each weight: S(w) = 2^(max(floor(log2 |w s|), emin) - mbits) / s.

    Exact (built like the quantizer's magic number, no log2). The exponent is also capped at the
    top binade, so |w s| beyond max gets the top ULP; w == 0 gets the subnormal ULP. This is the
    gap from w to the next code away from zero, the step the manifold optimizer measures in.
    """
    fmt = get_format(fmt)
    if not w.is_floating_point():
        raise TypeError(f"stiffness expects a floating-point tensor, got {w.dtype}")
    dtype = container_dtype(w.dtype)
    y = w.detach().to(dtype)
    s = None if scale is None else scale_tensor(scale, dtype, w.device)
    if s is not None:
        y = y * s
    step = ulp(y.abs(), grid_params(fmt, True, dtype, w.device), not fmt.subnormals)
    return (step if s is None else step / s).to(w.dtype)


def bit_stall_mask(w: torch.Tensor, delta: torch.Tensor, fmt: str | FormatSpec,
                   scale: Scale = None) -> torch.Tensor:
    """True where delta != 0 but quantize(w + delta) == quantize(w) (same fmt and scale)."""
    return (delta != 0) & (quantize(w + delta, fmt, scale) == quantize(w, fmt, scale))


def stall_stats(w: torch.Tensor, delta: torch.Tensor, fmt: str | FormatSpec,
                scale: Scale = None) -> dict[str, torch.Tensor]:
    """0-dim tensors: bit_stall_rate = stalled / updated (0 when nothing was updated),
    zero_update_frac = share of elements with delta == 0, and the counts num_stalled, num_updated.
    """
    updated = delta != 0
    num_updated = updated.sum()
    num_stalled = bit_stall_mask(w, delta, fmt, scale).sum()
    return {
        "bit_stall_rate": num_stalled / num_updated.clamp_min(1),
        "zero_update_frac": (delta.numel() - num_updated) / max(delta.numel(), 1),
        "num_stalled": num_stalled,
        "num_updated": num_updated,
    }
