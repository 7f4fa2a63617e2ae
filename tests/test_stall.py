"""Bit-stall and stiffness on hand-made cases: subnormals, binade edges, saturation, every code."""

import math

import pytest
import torch

from altgrad.quant import FORMATS, FormatSpec, decode, quantize
from altgrad.quant.stall import bit_stall_mask, stall_stats, stiffness

ALL = sorted(FORMATS)
CODES = torch.arange(256, dtype=torch.uint8)


pytestmark = pytest.mark.usefixtures("eager_kernels")


@pytest.mark.parametrize("name", ALL)
def test_stiffness_is_the_gap_to_the_next_code(name):
    f = FORMATS[name]
    codes = CODES[:127]  # every non-negative code below the last one
    w, nxt = decode(codes, f), decode(codes + 1, f)
    ok = nxt.isfinite()  # the step from max into inf/NaN codes is not a gap
    assert torch.equal(stiffness(w[ok], f), (nxt - w)[ok])
    assert torch.equal(stiffness(-w[ok], f), (nxt - w)[ok])  # symmetric
    assert stiffness(torch.tensor(0.0), f).item() == f.min_subnormal


@pytest.mark.parametrize("name", ALL)
def test_stiffness_caps_at_the_top_binade_and_handles_specials(name):
    f = FORMATS[name]
    top = stiffness(torch.tensor(f.max), f)
    w = torch.tensor([f.max * 8, math.inf, 1e-45, math.nan])
    s = stiffness(w, f)
    assert s[0] == top and s[1] == top and s[2].item() == f.min_subnormal and s[3].isnan()


def test_stiffness_examples_and_scale():
    w = torch.tensor([1.0, 0.99, 2.0, 447.0, 2.0**-7, 0.0])
    assert stiffness(w, "e4m3").tolist() == [0.125, 0.0625, 0.25, 32.0, 2.0**-9, 2.0**-9]
    # a power-of-two scale leaves normal ULPs alone; it moves the subnormal and saturated ends
    assert stiffness(w, "e4m3", scale=4.0).tolist() == [0.125, 0.0625, 0.25, 8.0, 2.0**-10,
                                                        2.0**-11]
    assert torch.equal(stiffness(w, "e4m3", scale=torch.tensor(4.0)), stiffness(w, "e4m3", scale=4.0))
    assert stiffness(w.bfloat16(), "e4m3").dtype == torch.bfloat16
    assert stiffness(torch.tensor([0.5, 1.0]), "e0m7").tolist() == [2.0**-6, 2.0**-6]
    ftz = FormatSpec("e4m3_ftz", 4, 3, 7, "fn", subnormals=False)
    assert stiffness(torch.tensor([0.0, 2.0**-8, 1.0]), ftz).tolist() == [2.0**-6, 2.0**-6, 0.125]


def test_stall_at_a_binade_edge_is_asymmetric():
    """Around 1.0 in e4m3 the ULP is 1/8 above and 1/16 below: |delta| < ULP/2 would get both
    sides wrong."""
    w = torch.ones(6)
    delta = torch.tensor([0.06, 0.0625, 0.07, -0.03, -0.03125, -0.032])
    # 1.0625 is a tie that rounds back to the even 1.0; 0.96875 is a tie that rounds up to 1.0
    assert bit_stall_mask(w, delta, "e4m3").tolist() == [True, True, False, True, True, False]


def test_stall_at_subnormals_and_zero():
    w = torch.tensor([0.0, 0.0, 0.0, 2.0**-9, 2.0**-9])
    delta = torch.tensor([2.0**-11, 2.0**-10, 2.0**-9, 2.0**-11, -2.0**-9])
    assert bit_stall_mask(w, delta, "e4m3").tolist() == [True, True, False, True, False]


def test_stall_at_saturation():
    w = torch.tensor([448.0, 448.0, -448.0, 57344.0, 7.875])
    delta = torch.tensor([100.0, -100.0, -1e6, 1e9, 1.0])
    assert bit_stall_mask(w[:3], delta[:3], "e4m3").tolist() == [True, False, True]
    assert bit_stall_mask(w[3:4], delta[3:4], "e5m2").tolist() == [True]
    assert bit_stall_mask(w[4:], delta[4:], "e2m5").tolist() == [True]


def test_zero_update_is_not_a_stall_and_scale_is_applied():
    w = torch.tensor([2.0**-8, 2.0**-8, 2.0**-8])
    delta = torch.tensor([0.0, 2.0**-11, -2.0**-11])
    assert bit_stall_mask(w, delta, "e4m3").tolist() == [False, True, True]
    # scaled by 64, w is a normal with ULP 2^-11 (unscaled): the same update now moves it
    assert bit_stall_mask(w, delta, "e4m3", scale=64.0).tolist() == [False, False, False]


def test_e7m0_stalls_until_the_midpoint():
    w = torch.full((5,), 4.0)
    delta = torch.tensor([1.9, 2.0, 2.1, -0.9, -1.0])
    # 6 = 1.5 * 4 is the tie between 4 (code 65, odd) and 8 (code 66, even): it moves up;
    # 3 is the tie between 2 (code 64, even) and 4: it moves down
    assert bit_stall_mask(w, delta, "e7m0").tolist() == [True, False, False, True, False]


def test_stall_matches_the_definition_on_random_updates():
    gen = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(50_000, generator=gen), "e3m4")
    delta = torch.randn(50_000, generator=gen) * 0.02 * torch.randint(0, 2, (50_000,), generator=gen)
    mask = bit_stall_mask(w, delta, "e3m4")
    expected = (delta != 0) & (quantize(w + delta, "e3m4") == w)
    assert torch.equal(mask, expected) and 0.1 < mask.float().mean() < 0.5


def test_stall_stats_counts_and_rates():
    w = torch.ones(8)
    delta = torch.tensor([0.0, 0.0, 0.01, 0.02, 0.5, 1.0, -0.01, 3.0])
    stats = stall_stats(w, delta, "e4m3")
    assert all(v.shape == () for v in stats.values())
    assert stats["num_updated"].item() == 6 and stats["num_stalled"].item() == 3
    assert stats["bit_stall_rate"].item() == 0.5
    assert stats["zero_update_frac"].item() == 0.25
    quiet = stall_stats(w, torch.zeros(8), "e4m3")
    assert quiet["bit_stall_rate"].item() == 0.0 and quiet["zero_update_frac"].item() == 1.0
    empty = stall_stats(torch.ones(0), torch.ones(0), "e4m3")
    assert empty["bit_stall_rate"].item() == 0.0 and empty["zero_update_frac"].item() == 0.0
