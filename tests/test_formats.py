"""FormatSpec: registry, derived values and code <-> value transfer against ml_dtypes and gfloat."""

import math

import gfloat
import ml_dtypes
import numpy as np
import pytest
import torch
from bitwise import same_values

from altgrad.quant import FORMATS, FormatSpec, decode, encode, get_format
from altgrad.quant.formats import DERIVED_VALUES

ALL = sorted(FORMATS)
ML_DTYPES = {"e5m2": ml_dtypes.float8_e5m2, "e4m3": ml_dtypes.float8_e4m3fn,
             "e3m4": ml_dtypes.float8_e3m4}
CODES = torch.arange(256, dtype=torch.uint8)


pytestmark = pytest.mark.usefixtures("eager_kernels")


def test_registry_matches_the_spec_table():
    assert set(FORMATS) == {"e5m2", "e4m3", "e3m4", "e0m7", "e1m6", "e2m5", "e6m1", "e7m0"}
    assert (FORMATS["e5m2"].bias, FORMATS["e5m2"].specials, FORMATS["e5m2"].max) == (15, "ieee", 57344)
    assert (FORMATS["e4m3"].bias, FORMATS["e4m3"].specials, FORMATS["e4m3"].max) == (7, "fn", 448)
    assert (FORMATS["e3m4"].bias, FORMATS["e3m4"].specials, FORMATS["e3m4"].max) == (3, "ieee", 15.5)
    for name in ("e0m7", "e1m6", "e2m5", "e6m1", "e7m0"):
        f = FORMATS[name]
        assert f.specials == "none" and f.subnormals and f.name == name
        assert f.bias == (2 ** (f.ebits - 1) - 1 if f.ebits > 1 else 0)
        assert f.num_finite_codes == 256


@pytest.mark.parametrize("name", ALL)
def test_derived_values_match_gfloat(name):
    f, g = FORMATS[name], FORMATS[name].to_gfloat()
    assert (g.expBits, g.tSignificandBits, g.bias) == (f.ebits, f.mbits, f.bias)
    assert f.max == g.max and f.emax == g.emax
    assert f.min_subnormal == g.smallest_subnormal
    assert f.emin == 1 - f.bias
    if f.ebits > 0:
        assert f.min_normal == g.smallest_normal
    assert f.num_finite_codes == 256 - g.num_nans - g.num_infs
    assert decode(torch.tensor([f.max_code], dtype=torch.uint8), f).item() == f.max


def test_e0_e1_convention_is_a_fixed_point_grid():
    k = torch.arange(128, dtype=torch.float32)
    assert torch.equal(decode(CODES[:128], FORMATS["e0m7"]), k / 64)
    assert torch.equal(decode(CODES[:128], FORMATS["e1m6"]), k / 32)
    assert FORMATS["e0m7"].emin == 1 > FORMATS["e0m7"].emax == 0
    e7m0 = decode(CODES[1:128], FORMATS["e7m0"])
    assert torch.equal(e7m0, torch.exp2(torch.arange(1, 128) - 63.0))


@pytest.mark.parametrize("name", ALL)
def test_decode_matches_gfloat_on_every_code(name):
    f = FORMATS[name]
    ref = gfloat.decode_ndarray(f.to_gfloat(), np.arange(256))
    assert same_values(decode(CODES, f), torch.from_numpy(ref))


@pytest.mark.parametrize("name", sorted(ML_DTYPES))
def test_decode_matches_ml_dtypes_on_every_code(name):
    ref = np.arange(256, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float32)
    assert same_values(decode(CODES, FORMATS[name]), torch.from_numpy(ref))


@pytest.mark.parametrize("name", ALL)
def test_encode_decode_round_trip_on_every_code(name):
    f = FORMATS[name]
    values = decode(CODES, f)
    codes = encode(values, f)
    assert same_values(decode(codes, f), values)
    finite = values.isfinite()
    assert torch.equal(codes[finite], CODES[finite])  # every finite code is canonical
    if f.nan_code is not None:  # NaN codes map to the canonical NaN with their sign
        nan = values.isnan()
        assert torch.equal(codes[nan], (CODES[nan] & 0x80) | f.nan_code)


@pytest.mark.parametrize("name", ALL)
def test_decode_is_monotone_and_sign_symmetric(name):
    f = FORMATS[name]
    pos, neg = decode(CODES[:128], f), decode(CODES[128:], f)
    finite = pos.isfinite()
    assert (pos[finite].diff() > 0).all()
    assert same_values(neg, -pos)


@pytest.mark.parametrize("name", sorted(ML_DTYPES))
def test_encode_matches_ml_dtypes(name):
    f = FORMATS[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(100_000, generator=gen) * torch.exp2(torch.randint(-20, 18, (100_000,), generator=gen))
    x = torch.cat([x.clamp(-f.max, f.max), torch.tensor([math.inf, -math.inf, math.nan, -math.nan, 0.0, -0.0])])
    ref = x.numpy().astype(ML_DTYPES[name]).view(np.uint8)
    assert torch.equal(encode(x, f), torch.from_numpy(ref))


@pytest.mark.parametrize("name", ALL)
def test_encode_matches_gfloat_and_saturates_finite_overflow(name):
    f = FORMATS[name]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(20_000, generator=gen, dtype=torch.float64) * 2.0 ** torch.randint(
        -70, 70, (20_000,), generator=gen)
    x = x.float()
    rounded = gfloat.round_ndarray(f.to_gfloat(), x.double().numpy(), sat=True)
    ref = gfloat.encode_ndarray(f.to_gfloat(), rounded).astype(np.uint8)
    assert torch.equal(encode(x, f), torch.from_numpy(ref))
    big = torch.tensor([f.max * 4, -f.max * 4])
    assert encode(big, f).tolist() == [f.max_code, f.max_code | 0x80]


def test_encode_specials_per_convention():
    inf_nan = torch.tensor([math.inf, -math.inf, math.nan])
    assert encode(inf_nan, FORMATS["e5m2"]).tolist() == [0x7C, 0xFC, 0x7E]
    assert encode(inf_nan, FORMATS["e4m3"]).tolist() == [0x7F, 0xFF, 0x7F]  # no inf: NaN, as ml_dtypes
    assert encode(inf_nan, FORMATS["e2m5"]).tolist() == [0x7F, 0xFF, 0x00]  # saturate; NaN -> +0
    assert encode(torch.tensor([-0.0, 0.0]), FORMATS["e4m3"]).tolist() == [0x80, 0x00]


def test_encode_and_decode_reject_wrong_dtypes():
    with pytest.raises(TypeError):
        decode(torch.arange(4), FORMATS["e4m3"])
    with pytest.raises(TypeError):
        encode(torch.arange(4), FORMATS["e4m3"])


def test_get_format_lookup_and_errors():
    assert get_format("E4M3") is FORMATS["e4m3"]
    assert get_format(" e7m0 ") is FORMATS["e7m0"]
    assert get_format("e05m2") is FORMATS["e5m2"]
    spec = FormatSpec("mine", 4, 3, 8, "none")
    assert get_format(spec) is spec
    with pytest.raises(ValueError, match="e0m7, e1m6, e2m5, e3m4, e4m3, e5m2, e6m1, e7m0"):
        get_format("fp8")
    with pytest.raises(ValueError, match="X \\+ Y = 7"):
        get_format("e3m3")
    with pytest.raises(ValueError, match="valid"):
        get_format("bf16")
    with pytest.raises(TypeError):
        get_format(8)


def test_next_mantissa_format_chain():
    chain, f = [], FORMATS["e7m0"]
    while f is not None:
        chain.append(f.name)
        f = f.next_mantissa_format()
    assert chain == ["e7m0", "e6m1", "e5m2", "e4m3", "e3m4", "e2m5", "e1m6", "e0m7"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(ebits=4, mbits=4, bias=7, specials="fn"), "must be 7"),
    (dict(ebits=4, mbits=3, bias=7, specials="inf"), "specials"),
    (dict(ebits=1, mbits=6, bias=0, specials="ieee"), "ieee"),
    (dict(ebits=0, mbits=7, bias=0, specials="none", subnormals=False), "subnormal"),
    (dict(ebits=7, mbits=0, bias=-10, specials="none"), "float32 range"),
    (dict(ebits=7, mbits=0, bias=250, specials="none"), "float32 range"),
    (dict(ebits=7, mbits=0, bias=46, specials="none"), "float32 range"),
    (dict(ebits=7, mbits=0, bias=128, specials="none"), "float32 range"),
])
def test_format_spec_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FormatSpec("bad", **kwargs)


def test_flush_to_zero_spec():
    ftz = FormatSpec("e4m3_ftz", 4, 3, 7, "fn", subnormals=False)
    assert ftz.max == 448 and ftz.min_subnormal == ftz.min_normal == 2.0**-6
    values = decode(CODES, ftz)
    assert (values[1:8] == 0).all() and (values[129:136] == 0).all() and values[129].signbit()
    assert torch.equal(values[8:127], decode(CODES[8:127], FORMATS["e4m3"]))
    assert torch.equal(encode(values[:127], ftz), torch.cat([torch.zeros(8, dtype=torch.uint8), CODES[8:127]]))
    with pytest.raises(ValueError, match="gfloat"):
        ftz.to_gfloat()


def test_derived_values_are_computed_once_and_traced_as_values():
    """Each derived value is cached at construction (what dynamo then reads is a value, not a
    property's function to trace at every read), equal to its definition; a compiled function that
    reads them compiles anew for another format and computes with its values."""
    assert [name for name, value in vars(FormatSpec).items() if isinstance(value, property)] == []
    assert {"max", "emax", "emin", "nan_code"} <= set(DERIVED_VALUES)
    for fmt in FORMATS.values():
        for name in DERIVED_VALUES:
            assert name in vars(fmt), (fmt.name, name)
            assert vars(fmt)[name] == type(fmt).__dict__[name].func(fmt), (fmt.name, name)
    holder = {"fmt": FORMATS["e4m3"]}

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * holder["fmt"].max + holder["fmt"].emax

    compiled = torch.compile(scaled, backend="eager", fullgraph=True)
    x = torch.ones(3)
    for name in ("e4m3", "e5m2", "e0m7"):
        holder["fmt"] = FORMATS[name]
        assert torch.equal(compiled(x), torch.full((3,), FORMATS[name].max + FORMATS[name].emax))
