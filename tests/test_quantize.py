"""quantize / fake_quantize: bit-exact against ml_dtypes and gfloat, on the eager and compiled paths.

Tests run eagerly unless they take the `path` fixture: every compiled graph costs seconds, so only
the float32 graphs training uses (plus bf16) are compiled here.
"""

import math
import warnings

import gfloat
import ml_dtypes
import numpy as np
import pytest
import torch
from bitwise import CODES, edge_values, random_values, same_values

from altgrad.quant import (
    FORMATS,
    FormatSpec,
    compile_status,
    decode,
    fake_quantize,
    kernels,
    quantize,
)

ALL = sorted(FORMATS)
ML_DTYPES = {"e5m2": ml_dtypes.float8_e5m2, "e4m3": ml_dtypes.float8_e4m3fn,
             "e3m4": ml_dtypes.float8_e3m4}


pytestmark = pytest.mark.usefixtures("eager_kernels")


def gfloat_round(f: FormatSpec, x: torch.Tensor) -> torch.Tensor:
    ref = gfloat.round_ndarray(f.to_gfloat(), x.double().numpy(), sat=True)
    return torch.from_numpy(ref)


def ml_dtypes_round(name: str, x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.numpy().astype(ML_DTYPES[name]).astype(np.float32))


# -- bit-exactness ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_matches_gfloat_on_codes_midpoints_and_specials(name, path):
    f = FORMATS[name]
    x = edge_values(f)
    q = quantize(x, f)
    assert q.dtype == torch.float32
    assert same_values(q, gfloat_round(f, x))


@pytest.mark.parametrize("name", ALL)
def test_matches_gfloat_on_a_million_random_values(name, path):
    f = FORMATS[name]
    x = random_values(f)
    assert same_values(quantize(x, f), gfloat_round(f, x))


@pytest.mark.parametrize("name", sorted(ML_DTYPES))
def test_matches_ml_dtypes_without_saturation(name, path):
    f = FORMATS[name]
    x = torch.cat([edge_values(f), random_values(f, seed=1)])
    assert same_values(quantize(x, f, saturate=False), ml_dtypes_round(name, x))


def test_every_float32_of_a_binade_matches_ml_dtypes(path):
    """All 2^23 floats in [1, 2) (every 5th when eager), moved to the subnormal, middle and top
    binade of e4m3."""
    mant = torch.arange(0, 1 << 23, 1 if path == "compiled" else 5, dtype=torch.int32) | (127 << 23)
    x = mant.view(torch.float32)
    for k in (-8, 0, 8):
        xk = x * 2.0**k
        assert same_values(quantize(xk, "e4m3", saturate=False), ml_dtypes_round("e4m3", xk))


def test_e7m0_binade_sample_matches_gfloat(path):
    f = FORMATS["e7m0"]
    x = (torch.arange(0, 1 << 23, 31, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    x = torch.cat([x * 2.0**k for k in (-63, -40, 0, 40, 64)])
    assert same_values(quantize(x, f), gfloat_round(f, x))


@pytest.mark.parametrize("spec", [FormatSpec("e7m0_top", 7, 0, 47, "none"),
                                  FormatSpec("e7m0_bottom", 7, 0, 127, "none"),
                                  FormatSpec("e2m5_bottom", 2, 5, 121, "none"),
                                  FormatSpec("e4m3_fn_biased", 4, 3, 20, "fn")])
def test_custom_specs_at_the_float32_limits_match_gfloat(spec):
    x = edge_values(spec)
    assert same_values(quantize(x, spec), gfloat_round(spec, x))
    assert same_values(quantize(x, spec, saturate=False)[x.isfinite()],
                       torch.from_numpy(gfloat.round_ndarray(
                           spec.to_gfloat(), x[x.isfinite()].double().numpy(), sat=spec.specials == "none")))


def test_ties_go_to_the_even_code_in_mantissa_free_formats(path):
    x = torch.tensor([3.0, 1.5, 6.0, 12.0, 0.75, 2.0**-63, 1.5 * 2.0**-62, 3 * 2.0**63, -3.0, -6.0,
                      0.75 * 2.0**-62, 0.25 * 2.0**-62])
    expected = [2.0, 2.0, 8.0, 8.0, 0.5, 0.0, 2.0**-61, 2.0**64, -2.0, -8.0, 2.0**-62, 0.0]
    assert quantize(x, "e7m0").tolist() == expected
    # e4m3 for contrast: ties to the even mantissa, including across a binade edge
    assert quantize(torch.tensor([1.0625, 1.1875, 15.5, 464.0, 2.0**-10]), "e4m3").tolist() == [
        1.0, 1.25, 16.0, 448.0, 0.0]


# -- semantics --------------------------------------------------------------------------------

def test_specials_and_saturation(path):
    x = torch.tensor([math.nan, math.inf, -math.inf, 1e6, -1e6, -0.0, -1e-30, 0.0])
    assert same_values(quantize(x, "e4m3"), torch.tensor(
        [math.nan, 448.0, -448.0, 448.0, -448.0, -0.0, -0.0, 0.0]))
    assert same_values(quantize(x, "e5m2", saturate=False), torch.tensor(
        [math.nan, math.inf, -math.inf, math.inf, -math.inf, -0.0, -0.0, 0.0]))
    assert same_values(quantize(x, "e4m3", saturate=False), torch.tensor(
        [math.nan, math.nan, math.nan, math.nan, math.nan, -0.0, -0.0, 0.0]))
    assert same_values(quantize(x, "e2m5", saturate=False), torch.tensor(
        [math.nan, 7.875, -7.875, 7.875, -7.875, -0.0, -0.0, 0.0]))


@pytest.mark.parametrize("scale", [2.0**-5, 3.0, torch.tensor(64.0), torch.tensor([0.7])])
def test_scale_is_quantize_of_scaled_over_scale(scale, path):
    x = random_values(FORMATS["e4m3"], n=4096, seed=3)
    s = scale if isinstance(scale, float) else scale.reshape(()).item()
    assert same_values(quantize(x, "e4m3", scale=scale), quantize(x * s, "e4m3") / s)


def test_shapes_and_layouts_are_preserved():
    x = torch.randn(3, 4, 5).transpose(0, 2)
    q = quantize(x, "e5m2")
    assert q.shape == x.shape and same_values(q, quantize(x.contiguous(), "e5m2"))
    assert quantize(torch.tensor(3.3), "e4m3").shape == ()
    assert quantize(torch.tensor(3.3), "e4m3").item() == 3.25
    assert quantize(torch.empty(0, 7), "e4m3").shape == (0, 7)


def test_bf16_inputs_round_like_float32(path):
    x = random_values(FORMATS["e4m3"], n=8192, seed=4).bfloat16()
    q = quantize(x, "e4m3")
    assert q.dtype == torch.bfloat16 and same_values(q, quantize(x.float(), "e4m3").bfloat16())


def test_fp16_inputs_round_like_float32():
    x = random_values(FORMATS["e5m2"], n=8192, seed=4).half()
    q = quantize(x, "e5m2")
    assert q.dtype == torch.float16 and same_values(q, quantize(x.float(), "e5m2").half())


@pytest.mark.parametrize("name", ALL)
def test_float64_inputs_round_once(name):
    """float64 is quantized in float64: values off the float32 grid must not be double-rounded."""
    f = FORMATS[name]
    v = decode(CODES[:127], f).double()
    v = v[v.isfinite()]
    mids = (v[1:] + v[:-1]) / 2
    x = torch.cat([mids * (1 + 2.0**-40), mids * (1 - 2.0**-40), random_values(f, 4096).double()
                   * (1 + 2.0**-35)])
    x = torch.cat([x, -x])
    q = quantize(x, f)
    assert q.dtype == torch.float64 and same_values(q, gfloat_round(f, x))


def test_flush_to_zero_format():
    ftz = FormatSpec("e4m3_ftz", 4, 3, 7, "fn", subnormals=False)
    m = 2.0**-6
    x = torch.tensor([m * 0.5, m * 0.51, m * 0.49, -m * 0.75, m * 1.0625, 1e-30, 300.0])
    assert quantize(x, ftz).tolist() == [0.0, m, 0.0, -m, m, 0.0, 288.0]
    sr = quantize(torch.full((1000,), m / 4), ftz, rounding="stochastic")
    assert set(sr.unique().tolist()) == {0.0, m}


# -- stochastic rounding ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_stochastic_rounding_is_unbiased_between_the_two_neighbours(name):
    f = FORMATS[name]
    v = decode(CODES[:127], f)
    v = v[v.isfinite()]
    i = len(v) // 2
    lo, hi = v[i].item(), v[i + 1].item()
    n, gen = 40_000, torch.Generator().manual_seed(5)
    for frac in (0.1, 0.5, 0.97):
        x = lo + frac * (hi - lo)
        q = quantize(torch.full((n,), x), f, rounding="stochastic", generator=gen)
        assert set(q.unique().tolist()) <= {lo, hi}
        p = (x - lo) / (hi - lo)
        sigma = (hi - lo) * math.sqrt(p * (1 - p) / n)
        assert abs(q.double().mean().item() - x) <= 6 * sigma


def test_stochastic_rounding_keeps_codes_and_is_reproducible(path):
    f = FORMATS["e4m3"]
    codes = decode(CODES, f)
    codes = codes[codes.isfinite()]
    assert same_values(quantize(codes, f, rounding="stochastic"), codes)
    x = random_values(f, n=1 << 16, seed=6).clamp(-f.max, f.max)
    a = quantize(x, f, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    b = quantize(x, f, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    assert same_values(a, b)
    grid = codes.double().unique()  # every result is one of the two codes around x
    i = torch.searchsorted(grid, x.double())
    up, down = grid[i], grid[(i - 1).clamp_min(0)]
    assert ((a == up) | (a == down)).all()
    assert (a != quantize(x, f)).any()


def test_stochastic_compiled_equals_eager(monkeypatch):
    x = random_values(FORMATS["e2m5"], n=1 << 16, seed=8)
    results = []
    for env in ("1", None):
        if env:
            monkeypatch.setenv("ALTGRAD_NO_COMPILE", env)
        else:
            monkeypatch.delenv("ALTGRAD_NO_COMPILE")
        gen = torch.Generator().manual_seed(9)
        results.append(quantize(x, "e2m5", scale=4.0, rounding="stochastic", generator=gen))
    assert compile_status() == "compiled"
    assert same_values(*results)


# -- fake_quantize (STE) ----------------------------------------------------------------------

@pytest.mark.parametrize("scale", [None, 2.0, torch.tensor(0.5)])
def test_fake_quantize_passes_the_gradient_straight_through(scale):
    x = (torch.randn(64, dtype=torch.float64) * 300).requires_grad_()
    y = fake_quantize(x, "e4m3", scale)
    assert same_values(y.detach(), quantize(x.detach(), "e4m3", scale))
    g = torch.randn(64, dtype=torch.float64)
    y.mul_(2)  # the output is a tensor of its own, not a view: in-place ops on it are allowed
    y.backward(g)
    assert torch.equal(x.grad, 2 * g)


def test_clipped_ste_zeroes_the_gradient_where_the_forward_saturated():
    x = torch.tensor([1.0, 100.0, 500.0, -449.0, -448.0, math.nan], requires_grad=True)
    fake_quantize(x, "e4m3", clip_ste=True).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    x.grad = None
    fake_quantize(x, "e4m3", scale=torch.tensor(4.0), clip_ste=True).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_fake_quantize_stochastic_uses_the_generator():
    x = torch.rand(1000, requires_grad=True)
    a = fake_quantize(x, "e2m5", rounding="stochastic", generator=torch.Generator().manual_seed(1))
    b = quantize(x.detach(), "e2m5", rounding="stochastic", generator=torch.Generator().manual_seed(1))
    assert same_values(a.detach(), b)


# -- compiled path management and errors -------------------------------------------------------

def test_compile_failure_falls_back_to_eager_once(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.delenv("ALTGRAD_NO_COMPILE")
    monkeypatch.setattr(kernels.Compiled, "registry", [])  # this broken kernel stays out of compile_status
    kernel = kernels.Kernel(kernels.nearest)
    p = kernels.grid_params(FORMATS["e4m3"], True, torch.float32, torch.device("cpu"))
    x = torch.randn(100) * 100
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        q = kernel(x, p, False, False)
    assert kernel.error == "RuntimeError: no compiler here"
    assert same_values(q, quantize(x, "e4m3"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel(x, p, False, False)  # remembered: no second attempt, no second warning


def test_no_compile_env_var_forces_eager(monkeypatch):
    monkeypatch.setenv("ALTGRAD_NO_COMPILE", "1")
    assert compile_status() == "eager (ALTGRAD_NO_COMPILE=1)"


@pytest.mark.parametrize("x", [torch.arange(4), torch.ones(3, dtype=torch.bool),
                               torch.ones(2, dtype=torch.complex64), [1.0, 2.0]])
def test_non_float_input_is_a_type_error(x):
    with pytest.raises(TypeError):
        quantize(x, "e4m3")


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf, torch.tensor(0.0),
                                   torch.tensor(-2.0), torch.tensor(math.nan),
                                   torch.tensor(math.inf), torch.ones(2)])
def test_bad_scale_is_a_value_error(scale):
    with pytest.raises(ValueError, match="scale"):
        quantize(torch.ones(4), "e4m3", scale=scale)


def test_bad_format_and_rounding_are_value_errors():
    with pytest.raises(ValueError, match="e0m7, e1m6"):
        quantize(torch.ones(4), "fp8")
    with pytest.raises(ValueError, match="X \\+ Y = 7"):
        quantize(torch.ones(4), "e3m3")
    with pytest.raises(ValueError, match="rounding"):
        quantize(torch.ones(4), "e4m3", rounding="up")
    with pytest.raises(TypeError):
        quantize(torch.ones(4), "e4m3", scale="2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unscaling_by_a_power_of_two_multiplies_by_the_exact_inverse(dtype):
    """`kernels.unscale(q, s, pow2=True)` is q * (1 / s): for every power of two a float32 scale
    can be (2^-126 ... 2^127), bit for bit q / s, also where the quotient is subnormal, zero,
    infinite or NaN. With a scale that is no power of two the product is not the quotient,
    so this would catch an `unscale` that took any scale's inverse."""
    f = FORMATS["e4m3"]
    q = torch.cat([edge_values(f), random_values(f, 1 << 14) * 2.0**100, random_values(f, 1 << 14) * 2.0**-120])
    q = q.to(dtype)
    for k in range(-126, 128):
        s = torch.tensor(2.0**k, dtype=torch.float32)
        assert same_values(kernels.unscale(q, s, True), q / s), k
    s = torch.tensor(3.0)
    assert not same_values(q * (1 / s), q / s)
    assert same_values(kernels.unscale(q, s, False), q / s)
