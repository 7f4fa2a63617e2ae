"""The report's note on formats that are one grid up to a power of two (`quant.equivalence`):
under amax scaling their trials are one result shown twice, and the report says so."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations

from altgrad.config import BASELINE
from altgrad.quant import FORMATS
from altgrad.quant.equivalence import power_of_two_shift


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
    specs = [FORMATS[f] for f in formats if f != BASELINE and f in FORMATS]
    pairs = []
    for a, b in combinations(sorted(specs, key=lambda s: s.max), 2):
        shift = power_of_two_shift(a, b)
        if shift is not None:
            pairs.append(Twins(a.name, b.name, shift))
    return pairs
