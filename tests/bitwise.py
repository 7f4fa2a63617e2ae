"""Helpers shared by the quantizer tests: the values they probe, and a bitwise comparison."""

import math

import numpy as np
import torch

from altgrad.quant import FormatSpec, decode

CODES = torch.arange(256, dtype=torch.uint8)
SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 2.0**-130, 1e-39, 3.4e38,
            -3.4e38, 2.0**-149 * 3]


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (so -0 != +0), except that any NaN matches any NaN."""
    if a.dtype != b.dtype:
        a, b = a.double(), b.double()
    if not a.is_floating_point():  # (integers, bools, generator states: no NaN, no -0)
        return torch.equal(a, b)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
    nan = a.float().isnan()  # (float8 has no isnan of its own)
    return torch.equal(nan, b.float().isnan()) and torch.equal(
        a.view(bits).masked_fill(nan, 0), b.view(bits).masked_fill(nan, 0))


def edge_values(f: FormatSpec) -> torch.Tensor:
    """Every code value, every midpoint between neighbouring codes (and above max) with its float32
    neighbours, the quarter points, both signs, plus zeros, infinities, NaN and float32 extremes."""
    v = decode(CODES[:128], f)
    v = v[v.isfinite()].double()
    v = torch.cat([v, 2 * v[-1:] - v[-2:-1]])  # one step beyond max
    gap = v[1:] - v[:-1]
    mids = (v[:-1] + gap / 2).float()
    up = torch.nextafter(mids, torch.tensor(math.inf))
    down = torch.nextafter(mids, torch.tensor(-math.inf))
    quarters = torch.cat([v[:-1] + gap / 4, v[:-1] + 3 * gap / 4]).float()
    pos = torch.cat([v.float(), mids, up, down, quarters])
    return torch.cat([pos, -pos, torch.tensor(SPECIALS)])


def random_values(f: FormatSpec, n: int = 1 << 20, seed: int = 0) -> torch.Tensor:
    """sign * 2^U(lo, hi) * U(1, 2), with the exponent range covering the format and beyond."""
    rng = np.random.default_rng(seed)
    lo, hi = f.emin - f.mbits - 6, max(f.emax, f.emin) + 4
    x = rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(lo, hi, n)) * rng.uniform(1, 2, n)
    return torch.from_numpy(x.astype(np.float32))


def ordinal(codes: torch.Tensor) -> torch.Tensor:
    """uint8 sign-magnitude codes -> integers monotone in the value they decode to (±0 -> 0)."""
    c = codes.long()
    return torch.where(c >= 0x80, -(c & 0x7F), c)
