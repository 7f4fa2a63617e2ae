"""E0M7 and E1M6 are one grid up to a factor 2: under per-tensor amax scaling they quantize alike.

This is why a sweep with the default scaling shows the same numbers for both (SPEC §2's gfloat
convention gives both formats bias 0); only `scaling.mode: none` tells them apart.
"""

from __future__ import annotations

import pytest
import torch

from altgrad.quant import FORMATS, quantize
from altgrad.quant.scaling import compute_scale
from altgrad.report.twins import power_of_two_twins


def sample() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g) * torch.logspace(-4, 4, 50_000)
    return x[torch.randperm(x.numel(), generator=g)]


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("amax", [None, 0.37, 1e-3])  # None: the tensor's own amax (dynamic)
def test_e0m7_and_e1m6_agree_under_amax_scaling(pow2, margin, amax):
    x = sample()
    amax = x.abs().max() if amax is None else torch.tensor(amax)
    out = {}
    for name in ("e0m7", "e1m6"):
        s = compute_scale(amax, name, margin=margin, pow2=pow2)
        out[name] = quantize(x * s, name) / s
    assert torch.equal(out["e0m7"], out["e1m6"])
    assert out["e0m7"].unique().numel() > 16  # many grid levels in use, not all saturated or flushed


def test_e0m7_and_e1m6_differ_without_scaling():
    x = sample()
    differ = (quantize(x, "e0m7") != quantize(x, "e1m6")).float().mean().item()
    assert differ > 0.5  # e1m6 reaches 127/32, e0m7 saturates at 127/64 and rounds twice as fine


def test_the_only_registered_twins_are_e0m7_and_e1m6():
    twins = power_of_two_twins(["bf16", *FORMATS])
    assert [(t.smaller, t.larger, t.shift) for t in twins] == [("e0m7", "e1m6", 1)]
