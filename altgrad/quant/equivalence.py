"""Formats that quantize every tensor identically under per-tensor amax scaling.

A per-tensor scale s = fmt.max / (amax · 2^margin) (rounded down to a power of two or not) puts a
tensor at the same place of either format when their value sets differ only by a factor 2^k: then
s_b = s_a · 2^k exactly and quantize(x·s_b)/s_b == quantize(x·s_a)/s_a bit for bit, ties included
(the codes' parities match too). The ULP that the manifold optimizer and format-stored weights use
is read at the layer's scale, so it scales the same way. E0M7 (k/64) and E1M6 (k/32) are such a pair
under the gfloat E ≤ 1 convention (bias 0); without scaling (`scaling.mode: none`) they differ.
Formats are data here, as everywhere: these functions take the specs as arguments.
"""

from __future__ import annotations

import math

from altgrad.quant.formats import FormatSpec, get_format


def power_of_two_shift(a: FormatSpec | str, b: FormatSpec | str) -> int | None:
    """k ≥ 1 with values(b) == values(a) · 2^k (same specials, same code parities), else None."""
    a, b = get_format(a), get_format(b)
    if (a.specials, a.subnormals) != (b.specials, b.subnormals):
        return None
    mantissa, exponent = math.frexp(b.max / a.max)
    if mantissa != 0.5 or exponent < 2:
        return None
    factor = 2.0 ** (exponent - 1)
    if [(v * factor, p) for v, p in _grid(a)] != _grid(b):
        return None
    return exponent - 1


def quantize_identically(a: FormatSpec | str, b: FormatSpec | str, amax_scaled: bool) -> bool:
    """Whether two formats give bit-identical training: the same format, or (with per-tensor amax
    scaling of every tensor they quantize) one grid up to a power of two."""
    a, b = get_format(a), get_format(b)
    if a == b:
        return True
    return amax_scaled and (power_of_two_shift(a, b) is not None or power_of_two_shift(b, a) is not None)


def _grid(spec: FormatSpec) -> list[tuple[float, int]]:
    """The non-negative finite values in order, each with its code's parity (ties go to even codes)."""
    return sorted((v, c % 2) for c in range(128) if math.isfinite(v := spec.value_of(c)))
