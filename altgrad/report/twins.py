"""Formats that are one grid up to a power of two: under amax scaling they train identically.

A per-tensor scale s = fmt.max / (amax · 2^margin) (power of two or not) puts a tensor at the same
place of either format when the two value sets differ only by a factor 2^k: then
quantize(x·s_b)/s_b == quantize(x·s_a)/s_a exactly, step for step, so two such trials are one result
shown twice. E0M7 (k/64, max 127/64) and E1M6 (k/32, max 127/32) are such a pair under the gfloat
E ≤ 1 convention (bias 0); they differ only with `scaling.mode: none`. The report says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations

from altgrad.config import BASELINE


@dataclass(frozen=True)
class Twins:
    """`larger`'s values are `smaller`'s × 2^`shift`; `identical` / `shared`: cells (same optimizer
    and precision) in which both formats ran with the same val-loss history / in which both ran."""

    smaller: str
    larger: str
    shift: int
    identical: int = 0
    shared: int = 0

    def note(self) -> str:
        head = (f"{self.smaller} and {self.larger} are one grid up to a factor 2^{self.shift} "
                f"({self.larger} = {2 ** self.shift} × {self.smaller}): with per-tensor amax scaling "
                "(`scaling.mode` dynamic or delayed, the default) they quantize every tensor "
                "identically, so their trials are one result reported twice, not two independent "
                "ones; only `scaling.mode: none` tells them apart.")
        if self.shared == 0:
            return head
        if self.identical == self.shared:
            return f"{head} Here their val-loss histories are identical in all {self.shared} shared cells."
        return (f"{head} Here they differ in {self.shared - self.identical} of {self.shared} shared "
                "cells, so those trials did not both use amax scaling (or used other settings).")


def power_of_two_twins(formats: Iterable[str]) -> list[Twins]:
    """Every pair of the given 8-bit formats whose values (and ties-to-even code parities) are the
    same up to a power of two; bf16 and unknown names are skipped."""
    from altgrad.quant import FORMATS

    specs = [FORMATS[f] for f in formats if f != BASELINE and f in FORMATS]
    pairs = []
    for a, b in combinations(sorted(specs, key=lambda s: s.max), 2):
        shift = _shift(a, b)
        if shift is not None:
            pairs.append(Twins(a.name, b.name, shift))
    return pairs


def _shift(a, b) -> int | None:
    """k with values(b) == values(a) · 2^k (positive k, same specials), else None."""
    if (a.specials, a.subnormals) != (b.specials, b.subnormals):
        return None
    mantissa, exponent = math.frexp(b.max / a.max)
    if mantissa != 0.5 or exponent < 2:
        return None
    factor = 2.0 ** (exponent - 1)
    if [(v * factor, p) for v, p in _grid(a)] != _grid(b):
        return None
    return exponent - 1


def _grid(spec) -> list[tuple[float, int]]:
    """The non-negative finite values in order, each with its code's parity (ties go to even codes)."""
    return sorted((v, c % 2) for c in range(128) if math.isfinite(v := spec.value_of(c)))
