"""encode and code_moves: the compiled code kernels against gfloat / ml_dtypes codes, every format."""

import math

import gfloat
import ml_dtypes
import numpy as np
import pytest
import torch
from bitwise import edge_values, ordinal, random_values

from altgrad.quant import FORMATS, FormatSpec, bit_stall_mask, code_moves, encode, quantize
from altgrad.quant.codes import (
    BINCOUNT_MIN_CODES,
    CODE_COUNT,
    MOVE_BINS,
    code_moves_all,
    encode_samples,
)
from altgrad.quant.kernels import scale_tensors
from altgrad.quant.stall import stiffness
from altgrad.quant.step import STATS_RUNS, STATS_SAMPLE, TensorStats, sample

ALL = sorted(FORMATS)
ML_DTYPES = {"e5m2": ml_dtypes.float8_e5m2, "e4m3": ml_dtypes.float8_e4m3fn, "e3m4": ml_dtypes.float8_e3m4}
MOVE_EDGES = (1, 2, 3, 4, 8, 16)


pytestmark = pytest.mark.usefixtures("eager_kernels")


def gfloat_codes(f: FormatSpec, x: torch.Tensor) -> torch.Tensor:
    """The reference: gfloat's saturating round and its encoding; for ±inf and NaN in the
    ml_dtypes formats, ml_dtypes' cast (an 'fn' format has no inf: ±inf becomes NaN)."""
    fi = f.to_gfloat()
    finite = x.isfinite()
    codes = torch.zeros(x.shape, dtype=torch.uint8)
    rounded = gfloat.round_ndarray(fi, x[finite].double().numpy(), sat=True)
    codes[finite] = torch.from_numpy(gfloat.encode_ndarray(fi, rounded).astype(np.uint8))
    if f.name in ML_DTYPES:
        codes[~finite] = torch.from_numpy(x[~finite].numpy().astype(ML_DTYPES[f.name]).view(np.uint8))
    else:
        codes[~finite] = torch.where(x[~finite] > 0, f.max_code, f.max_code | 0x80).to(torch.uint8)
    return codes


@pytest.mark.parametrize("name", ALL)
def test_encode_matches_the_reference_on_edges_and_random_values(name, path):
    f = FORMATS[name]
    x = torch.cat([edge_values(f), random_values(f, n=1 << 16, seed=3)])
    if f.specials == "none":  # no NaN code: NaN encodes as +0; ±inf saturates
        assert (encode(x[x.isnan()], f) == 0).all()
        x = x[~x.isnan()]
    assert torch.equal(encode(x, f), gfloat_codes(f, x))


@pytest.mark.parametrize("name", ["e4m3", "e7m0", "e0m7"])
def test_encode_with_a_scale_is_encode_of_the_scaled_values(name, path):
    f = FORMATS[name]
    x = random_values(f, n=1 << 14, seed=4)
    s = torch.tensor(2.0**-3)
    assert torch.equal(encode(x, f, s), encode(x * s, f))


@pytest.mark.parametrize("name", ["e4m3", "e7m0", "e2m5"])
# scatter, bincount, and a tensor counted on a sample of STATS_RUNS runs
@pytest.mark.parametrize("n", [BINCOUNT_MIN_CODES // 4, 4 * BINCOUNT_MIN_CODES, 3 * STATS_SAMPLE + 5])
def test_the_code_histogram_counts_each_code(name, n, path):
    """The counters' 256-code histogram, on either side of the size where it changes method, is
    the count of gfloat's codes of quantize(x * s), with overflow and underflow counted too. A
    tensor over STATS_SAMPLE elements histograms STATS_SAMPLE of its elements (each code at most as
    often as in the whole) and counts overflow and underflow as estimates of the whole's."""
    f = FORMATS[name]
    x = torch.cat([torch.tensor([f.max * 4, 0.0]), random_values(f, n=n, seed=5)])
    x = x[x.isfinite()][:n]
    s = torch.tensor(2.0**-2)
    stats = TensorStats()
    stats.observe(x, quantize(x, f, s), f, s)
    (overflow, underflow, elements), histogram = (t.tolist() for t in stats.counts())
    want = torch.bincount(gfloat_codes(f, x * s).long(), minlength=CODE_COUNT)
    want_overflow, want_underflow = int(((x * s).abs() > f.max).sum()), int(((x != 0) & (quantize(x, f, s) == 0)).sum())
    assert elements == n and want_overflow > 0
    if n <= STATS_SAMPLE:
        assert histogram == want.tolist() and (overflow, underflow) == (want_overflow, want_underflow)
    else:
        assert sum(histogram) == STATS_SAMPLE and all(h <= w for h, w in zip(histogram, want.tolist(), strict=True))
        assert overflow == pytest.approx(want_overflow, rel=0.2) and underflow == pytest.approx(want_underflow, rel=0.2)


def test_a_sample_is_one_run_in_each_stratum_at_offsets_that_differ():
    """Sampled positions: STATS_RUNS runs of contiguous positions (wrapping around in their
    stratum), one in each STATS_RUNS-th of the tensor, none twice, at offsets that are not all the
    stratum's start (runs at the starts saw only a row's first columns)."""
    n = 64 * 50257
    positions = sample(torch.arange(n, dtype=torch.float64)).long().view(STATS_RUNS, -1)
    period = n // STATS_RUNS
    assert positions.shape == (STATS_RUNS, STATS_SAMPLE // STATS_RUNS) and positions.unique().numel() == STATS_SAMPLE
    within = positions - torch.arange(STATS_RUNS)[:, None] * period
    assert ((0 <= within) & (within < period)).all()
    assert (((within[:, 1:] - within[:, :-1]) % period) == 1).all()
    assert within[:, 0].unique().numel() == STATS_RUNS


@pytest.mark.parametrize("rows, columns", [(64, 50257), (128, 5000), (512, 50304), (64, 4096), (192, 1031)])
def test_a_sampled_tensors_rates_estimate_the_whole_tensors_whatever_its_row_length(rows, columns, path):
    """A logits gradient's columns differ (token ids): here the first 1024 columns underflow and the
    last 512 overflow. The counters' rates of a sampled tensor are within 0.02 of the whole tensor's
    for any row length, one that lines the rows up with the strata included (runs at each stratum's
    start read 1.0 underflow for 64 x 50257, where the tensor has 0.02), and with several rows to a
    stratum (runs evenly spread through their strata, the k-th k/64 of the way in, read 0.07 for
    512 x 50304, the cpu preset's logits: 8 rows a stratum put them on 8 columns)."""
    f = FORMATS["e4m3"]
    x = torch.ones(rows, columns) * torch.linspace(1, 2, columns)
    x[:, :1024] = 1e-9
    x[:, -512:] = 1e6
    s = torch.tensor(1.0)
    q = quantize(x, f, s)
    stats = TensorStats()
    stats.observe(x, q, f, s)
    overflow, underflow, elements = stats.counts()[0].tolist()
    assert elements == x.numel()
    whole_underflow = ((x != 0) & (q == 0)).double().mean().item()
    whole_overflow = ((x * s).abs() > f.max).double().mean().item()
    assert abs(underflow / elements - whole_underflow) < 0.02 and abs(overflow / elements - whole_overflow) < 0.02


def test_counts_summed_over_tensors_weigh_each_by_its_size():
    """A small tensor counted whole (every element overflows) and a large one sampled (none does):
    the summed overflow rate is the elements' rate, 1000 / 1,001,000, not the samples' (1000 of
    1000 + STATS_SAMPLE)."""
    f, s = FORMATS["e4m3"], torch.tensor(1.0)
    stats = TensorStats()
    for x in (torch.full((1000,), 1e6), torch.ones(1_000_000)):
        stats.observe(x, quantize(x, f, s), f, s)
    assert stats.counts()[0].tolist() == [1000, 0, 1_001_000]


def reference_moves(w_old: torch.Tensor, w_new: torch.Tensor, f: FormatSpec, s: torch.Tensor,
                    kept: torch.Tensor | None = None):
    """changed, stalled (SPEC §2, through the eager quantizer) and the histogram, in plain Python;
    with `kept`, the codes are kept's (what a weight stored in its format became of w_new)."""
    after = w_new if kept is None else kept
    distance = (ordinal(gfloat_codes(f, after * s)) - ordinal(gfloat_codes(f, w_old * s))).abs()
    bins = [sum(int(d) >= e for e in MOVE_EDGES) for d in distance.tolist()]
    histogram = torch.bincount(torch.tensor(bins), minlength=len(MOVE_BINS))
    changed = w_new != w_old
    stalled = changed & (quantize(after, f, s) == quantize(w_old, f, s))
    return changed, stalled, histogram


@pytest.mark.parametrize("name", ALL)
def test_code_moves_counts_codes_moved_and_stalls(name, path):
    f = FORMATS[name]
    gen = torch.Generator().manual_seed(5)
    s = torch.tensor(2.0**-2)
    w_old = quantize(random_values(f, n=1 << 14, seed=6), f) / s  # on the grid ...
    w_old[::7] += torch.randn(w_old[::7].shape, generator=gen) * w_old[::7] * 0.1  # ... and off it
    ulps = torch.randint(-40, 41, w_old.shape, generator=gen).float()
    step = ulps * w_old.abs().clamp_min(f.min_subnormal / s.item()) * 2.0**-f.mbits / 4
    w_new = torch.where(torch.arange(w_old.numel()) % 5 == 0, w_old, w_old + step)  # some unchanged
    w_new[:8] = -w_old[:8]  # through zero
    changed, stalled, histogram = reference_moves(w_old, w_new, f, s)
    got = code_moves(w_old, w_new, f, s)
    assert int(got["changed"]) == int(changed.sum())
    assert int(got["stalled"]) == int(stalled.sum())
    assert torch.equal(got["histogram"], histogram)
    assert 0 < int(got["stalled"]) < int(changed.sum()) and histogram[1:].sum() > 0  # both kinds seen
    exact = w_old + (w_new - w_old) == w_new  # there bit_stall_mask's w + delta is w_new
    assert torch.equal(bit_stall_mask(w_old, w_new - w_old, f, s)[exact], stalled[exact])

    # many weights in one call, each with its own shape and scale, as the diagnostics do
    pairs = [(w_old, w_new, s), (w_new[:999].view(27, 37), w_old[:999].view(27, 37), torch.tensor(1.0)),
             (w_old[5:], w_old[5:] * 1.5, torch.tensor(0.375))]
    olds, news, scales = (list(x) for x in zip(*pairs, strict=True))
    together = code_moves_all(olds, news, f, scales)
    for i, (a, b, scale) in enumerate(pairs):
        alone = code_moves(a, b, f, scale)
        assert all(torch.equal(together[k][i], alone[k]) for k in alone), i


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e7m0", "e0m7"])
def test_code_moves_of_weights_stored_in_their_format_count_the_stored_codes(name, path):
    """Weights stored in their format are re-quantized after the update, stochastically under
    `quant.weight_rounding: stochastic`: a weight whose update rounds to nearest back to its code
    may still move one, and one that would move may stay. With `kept`, the stored weights, the
    stall and the histogram are the stored codes' moves, and `changed` is still the update's."""
    f = FORMATS[name]
    gen = torch.Generator().manual_seed(11)
    s = torch.tensor(2.0**-1)
    w_old = quantize(random_values(f, n=1 << 12, seed=12), f, s)  # stored: on the grid
    w_old = w_old[w_old.isfinite()]
    step = stiffness(w_old, f, s) * (torch.rand(w_old.shape, generator=gen) - 0.5) * 0.8  # under half an ULP
    w_new = torch.where(torch.arange(w_old.numel()) % 6 == 0, w_old, w_old + step)  # some not updated
    kept = quantize(w_new, f, s, rounding="stochastic", generator=gen)
    changed, stalled, histogram = reference_moves(w_old, w_new, f, s, kept)
    got = code_moves(w_old, w_new, f, s, kept=kept)
    assert int(got["changed"]) == int(changed.sum())
    assert int(got["stalled"]) == int(stalled.sum())
    assert torch.equal(got["histogram"], histogram)
    # to nearest nearly all of these updates stall; stochastically a good share moves a code
    nearest = code_moves(w_old, w_new, f, s)
    assert int(got["stalled"]) < 0.9 * int(nearest["stalled"]) and histogram[1] > 0
    # kept = w_new, or w_new stored to nearest (at any scale), is the plain call
    assert all(torch.equal(code_moves(w_old, w_new, f, s, kept=w_new)[k], v) for k, v in nearest.items())
    for scale in (s, torch.tensor(0.375), torch.tensor(1.37 * 2.0**5)):
        plain = code_moves(w_old, w_new, f, scale)
        stored = code_moves(w_old, w_new, f, scale, kept=quantize(w_new, f, scale))
        assert all(torch.equal(stored[k], v) for k, v in plain.items()), float(scale)
    # a kept of another shape is refused
    with pytest.raises(ValueError, match="shapes differ"):
        code_moves_all([w_old], [w_new], f, [s], kept=[w_new[1:]])


def test_a_list_of_scales_is_checked_at_once_and_a_bad_one_is_named():
    """The diagnostics pass every layer's scale at once (`scale_tensors`): stacked and checked in
    one go, as strictly as one scale alone; a list of other kinds takes each scale's own check."""
    w = torch.linspace(-1, 1, 64)
    scales = [torch.tensor(0.5), torch.tensor(2.0, dtype=torch.float64), torch.tensor(8.0)]
    assert torch.equal(scale_tensors(scales, torch.float32, w.device), torch.tensor([0.5, 2.0, 8.0]))
    mixed = [0.5, None, torch.tensor([4.0])]
    assert torch.equal(scale_tensors(mixed, torch.float64, w.device), torch.tensor([0.5, 1.0, 4.0], dtype=torch.float64))
    for bad in (0.0, -2.0, math.nan, math.inf):
        listed = [torch.tensor(1.0), torch.tensor(bad), torch.tensor(4.0)]
        with pytest.raises(ValueError, match=f"scale must be finite and > 0, got {bad}"):
            code_moves_all([w] * 3, [w * 1.01] * 3, "e4m3", listed)
        with pytest.raises(ValueError, match=f"got {bad}"):
            encode_samples([w] * 3, [torch.arange(4)] * 3, "e4m3", listed)
    # each weight is coded with its own scale of the list
    codes = encode_samples([w, w], [torch.arange(64), torch.arange(64)], "e4m3", [torch.tensor(0.5), torch.tensor(8.0)])
    assert torch.equal(codes[0], encode(w, "e4m3", 0.5)) and torch.equal(codes[1], encode(w, "e4m3", 8.0))
