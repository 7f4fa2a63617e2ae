"""8-bit floating-point formats as data: one frozen `FormatSpec` per format, everything else derived.

Pure data: nothing here computes on tensors. Rounding, encoding and decoding are functions that
take the format as an argument (`altgrad.quant.kernels`, `quantize`, `codes`), so this module
imports none of them.

A code is 1 sign bit, `ebits` exponent bits and `mbits` mantissa bits. Exponent field 0 holds the
subnormals (0.m * 2^emin) and zero; field f > 0 holds the normals 1.m * 2^(f - bias).
`specials` says which codes are not finite numbers:

- ``ieee``: the all-ones exponent field is reserved, mantissa 0 = ±inf, anything else NaN (e5m2, e3m4);
- ``fn``: no infinities, only S.1111.111 is NaN (e4m3, the OCP "fn" convention);
- ``none``: all 256 codes are finite; out-of-range values always saturate.

E0/E1 convention (the exotic end of the E0M7 ... E7M0 ladder): the bias is 2^(E-1) - 1 for E >= 2
and 0 for E <= 1, exactly gfloat's reading of such a format (`to_gfloat`). E0M7 has no exponent
field, so every code is a subnormal m * 2^(emin - 7) with emin = 1 - bias = 1: a fixed-point grid
k/64, |k| <= 127, max 127/64. E1M6 adds one normal binade [2, 4) with the same spacing 1/32, so it is
fixed point too (k/32, max 127/32). For E0 `emin` (1) exceeds `emax` (0): there is no normal range,
and `emin` only sets the ULP. E7M0 has no mantissa bits: every code is a power of two
2^(f - 63), zero is code 0, and "ties to even" means the even *code* (3 -> 2, not 4).

`subnormals=False` flushes: exponent-field-0 codes all decode to ±0 and values below `min_normal`
round to 0 or `min_normal`. No registered format uses it, and gfloat's `has_subnormals=False` means
something else (an extra normal binade), so such specs have no gfloat equivalent.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import gfloat

Specials = Literal["ieee", "fn", "none"]
_SPECIALS = ("ieee", "fn", "none")
_EXMY = re.compile(r"e(\d+)m(\d+)")


@dataclass(frozen=True)
class FormatSpec:
    """A signed 8-bit float format: sign, `ebits` exponent bits, `mbits` mantissa bits."""

    name: str
    ebits: int
    mbits: int
    bias: int
    specials: Specials
    subnormals: bool = True

    def __post_init__(self) -> None:
        if self.ebits < 0 or self.mbits < 0 or self.ebits + self.mbits != 7:
            raise ValueError(f"{self.name}: ebits + mbits must be 7 (8-bit codes), got "
                             f"e{self.ebits}m{self.mbits}")
        if self.specials not in _SPECIALS:
            raise ValueError(f"{self.name}: specials must be one of {_SPECIALS}, got {self.specials!r}")
        if self.specials == "ieee" and (self.ebits < 2 or self.mbits < 1):
            raise ValueError(f"{self.name}: 'ieee' specials need >= 2 exponent and >= 1 mantissa bits")
        if not self.subnormals and self.ebits == 0:
            raise ValueError(f"{self.name}: an E0 format is all subnormals; subnormals=False is empty")
        # The quantizer's float32 intermediates: ULPs 2^(e - mbits) must be normal, and
        # 2^(e + 23 - mbits) * (2^23 + 1) must not overflow.
        if self.emin - self.mbits < -126 or max(self.emax, self.emin) > 80:
            raise ValueError(f"{self.name}: bias {self.bias} puts the format outside float32 range")
        for derived in DERIVED_VALUES:  # cached now: a step graph's trace then reads values, not calls
            getattr(self, derived)

    # -- derived values -----------------------------------------------------------------------

    @cached_property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal (for E0, of the absent normal range)."""
        return 1 - self.bias

    @cached_property
    def emax(self) -> int:
        """floor(log2(max)), as gfloat defines it."""
        return math.frexp(self.max)[1] - 1

    @cached_property
    def max(self) -> float:
        """Largest finite value."""
        return self.value_of(self.max_code)

    @cached_property
    def min_normal(self) -> float:
        """2^emin, where the ULP starts doubling per binade (for E0 above `max`)."""
        return math.ldexp(1.0, self.emin)

    @cached_property
    def min_subnormal(self) -> float:
        """Smallest positive value."""
        return math.ldexp(1.0, self.emin - self.mbits) if self.subnormals else self.min_normal

    @cached_property
    def max_code(self) -> int:
        """Code of +max."""
        if self.specials == "ieee":
            return (((1 << self.ebits) - 1) << self.mbits) - 1
        return 0x7E if self.specials == "fn" else 0x7F

    @cached_property
    def nan_code(self) -> int | None:
        """Canonical +NaN code (ml_dtypes' choice: quiet bit set), None if the format has no NaN."""
        if self.specials == "ieee":
            return self._top_field | (1 << (self.mbits - 1))
        return 0x7F if self.specials == "fn" else None

    @cached_property
    def inf_code(self) -> int | None:
        """Code of +inf, None if the format has none."""
        return self._top_field if self.specials == "ieee" else None

    @cached_property
    def num_finite_codes(self) -> int:
        """Codes that decode to a finite value (±0 count twice)."""
        return sum(math.isfinite(self.value_of(code)) for code in range(256))

    @cached_property
    def _top_field(self) -> int:
        return ((1 << self.ebits) - 1) << self.mbits

    def value_of(self, code: int) -> float:
        """Exact value of one code (python float), the definition `codes.decode` tabulates."""
        sign = -1.0 if code & 0x80 else 1.0
        field = (code & 0x7F) >> self.mbits
        mant = code & ((1 << self.mbits) - 1)
        if self.specials == "ieee" and field == (1 << self.ebits) - 1:
            return math.copysign(math.inf if mant == 0 else math.nan, sign)
        if self.specials == "fn" and code & 0x7F == 0x7F:
            return math.copysign(math.nan, sign)
        if field == 0:
            return sign * math.ldexp(mant, self.emin - self.mbits) if self.subnormals else sign * 0.0
        return sign * math.ldexp((1 << self.mbits) + mant, field - self.bias - self.mbits)


    def next_mantissa_format(self) -> FormatSpec | None:
        """The registered format with one exponent bit traded for a mantissa bit (SPEC §6 shift)."""
        return None if self.ebits == 0 else FORMATS[f"e{self.ebits - 1}m{self.mbits + 1}"]

    def to_gfloat(self) -> gfloat.FormatInfo:
        """The gfloat FormatInfo with the same value set (the test oracle; gfloat is a dev extra)."""
        import gfloat

        if not self.subnormals:
            raise ValueError(f"{self.name}: gfloat has no flush-to-zero format")
        high_nans = {"ieee": (1 << self.mbits) - 1, "fn": 1, "none": 0}[self.specials]
        return gfloat.FormatInfo(
            self.name, k=8, precision=self.mbits + 1, bias=self.bias, is_signed=True,
            domain=gfloat.Domain.Extended if self.specials == "ieee" else gfloat.Domain.Finite,
            has_nz=True, num_high_nans=high_nans, has_subnormals=True, is_twos_complement=False)


# The derived values, each a `cached_property` computed at construction: dynamo traces a property's
# function at every read (in a step graph's trace, hundreds), and reads a cached value as a constant
# (docs/design.md, "Dynamo's trace of a warm trial").
DERIVED_VALUES = tuple(name for name, value in vars(FormatSpec).items() if isinstance(value, cached_property))


def _exotic(ebits: int) -> FormatSpec:
    """The 'none'-convention format with `ebits` exponent bits (bias 0 for E <= 1)."""
    return FormatSpec(f"e{ebits}m{7 - ebits}", ebits, 7 - ebits,
                      (1 << (ebits - 1)) - 1 if ebits > 1 else 0, "none")


FORMATS: dict[str, FormatSpec] = {
    "e5m2": FormatSpec("e5m2", 5, 2, 15, "ieee"),
    "e4m3": FormatSpec("e4m3", 4, 3, 7, "fn"),
    "e3m4": FormatSpec("e3m4", 3, 4, 3, "ieee"),
    **{f.name: f for f in map(_exotic, (0, 1, 2, 6, 7))},
}


def exmy_bits(name: str) -> tuple[int, int] | None:
    """(exponent bits, mantissa bits) that an `eXmY` name spells (any case), None for any other
    name; whether such a format exists is `get_format`'s to say."""
    m = _EXMY.fullmatch(name.strip().lower())
    return (int(m[1]), int(m[2])) if m else None


def get_format(fmt: str | FormatSpec) -> FormatSpec:
    """Look a format up by (case-insensitive) name; a FormatSpec passes through."""
    if isinstance(fmt, FormatSpec):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"format must be a name or a FormatSpec, got {type(fmt).__name__}")
    key = fmt.strip().lower()
    if m := _EXMY.fullmatch(key):
        ebits, mbits = int(m[1]), int(m[2])
        if ebits + mbits != 7:
            raise ValueError(f"format {fmt!r}: eXmY needs X + Y = 7 (1 sign + 7 bits), "
                             f"got {ebits} + {mbits}")
        return FORMATS[f"e{ebits}m{mbits}"]
    raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(sorted(FORMATS))} "
                     "(any eXmY with X + Y = 7)")
