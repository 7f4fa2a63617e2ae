"""From values to 8-bit codes, and how many codes a weight moved: compiled like the quantizer.

The diagnostics ask two questions of every quantized weight on every diagnostic step -- which code
does it sit on, and how many codes did the optimizer step move it -- so these run over the whole
model (3.2M elements for the tied GPT-2 head alone). Both reuse the quantizer's exact rounding and
read a code's magnitude off the rounded value's float32 bits, with no division and no second
rounding. A normal grid value |q| = 2^e * (1 + m / 2^mbits) has the bits (e + 127) * 2^23 +
m * 2^(23 - mbits), and its code is (e + bias) * 2^mbits + m, so

    ordinal(|q|) = bits(|q|) * 2^(mbits - 23) - (127 - bias) * 2^mbits    (|q| >= 2^emin)
    ordinal(|q|) = |q| / 2^(emin - mbits)                                   (subnormals, zero)

both exact in float32: an on-grid value's bits have at most 8 + mbits significant bits. Signed
ordinals are monotone in value, so the code distance between two weights is a subtraction, and
Q(w_new) == Q(w_old) is distance zero.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from altgrad.quant.formats import FormatSpec, get_format
from altgrad.quant.kernels import (
    MAX,
    MIN_NORMAL,
    Kernel,
    Scale,
    constants,
    family,
    format_constants,
    grid_params,
    round_nearest,
    scale_tensor,
    scale_tensors,
)

MOVE_BINS = ("0", "1", "2", "3", "4-7", "8-15", "16+")
_MOVE_EDGES = (1, 2, 3, 4, 8, 16)  # lower edges of the bins after "0"
# The entries of `code_params`.
BITS_TO_CODE = 0      # 2^(mbits - 23): a normal value's float32 bits, scaled to code units ...
CODE_OFFSET = 1       # ... less (127 - bias) * 2^mbits, are its code
SUBNORMAL_TO_CODE = 2  # 2^(mbits - emin): a subnormal (or zero) times this is its code
INF_CODE = 3          # the code of +inf (-1 where inf saturates to max like any overflow)
NAN_CODE = 4          # the NaN code ...
NAN_SIGN = 5          # ... and its sign bit (0x80, or 0 for 'none' formats, which encode NaN as +0)


@format_constants
def _code_values(fmt: FormatSpec) -> tuple[float, ...]:
    inf = fmt.inf_code if fmt.specials == "ieee" else fmt.nan_code if fmt.specials == "fn" else -1
    nan, nan_sign = (fmt.nan_code, 0x80) if fmt.nan_code is not None else (0, 0)
    values = {BITS_TO_CODE: 2.0 ** (fmt.mbits - 23), CODE_OFFSET: (127 - fmt.bias) * 2.0 ** fmt.mbits,
              SUBNORMAL_TO_CODE: 2.0 ** (fmt.mbits - fmt.emin), INF_CODE: inf, NAN_CODE: nan, NAN_SIGN: nan_sign}
    return tuple(float(values[i]) for i in range(len(values)))


def code_params(fmt: FormatSpec, device: torch.device) -> torch.Tensor:
    """fmt's code layout as one float32 tensor (entries BITS_TO_CODE ... NAN_SIGN)."""
    return constants(_code_values(fmt), torch.float32, device)


def _magnitude(a: torch.Tensor, p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Code of the non-negative float32 grid value `a`, as an exact float32 integer (NaN stays NaN).
    Below min_normal a flush-to-zero grid holds only 0, and an E0 grid lies there whole."""
    normal = a.view(torch.int32).to(torch.float32) * c[BITS_TO_CODE] - c[CODE_OFFSET]
    return torch.where(a >= p[MIN_NORMAL], normal, a * c[SUBNORMAL_TO_CODE])


def _negative(y: torch.Tensor) -> torch.Tensor:
    """The sign bit, -0 and NaN included (`torch.signbit` does not vectorize in inductor)."""
    return y.view(torch.int32) < 0


def _encode(x: torch.Tensor, scale: torch.Tensor, p: torch.Tensor, c: torch.Tensor, m0: bool,
            ftz: bool) -> torch.Tensor:
    y = x.to(torch.float32) * scale
    q = round_nearest(y, p, m0, ftz)
    code = _magnitude(q.abs(), p, c) + torch.where(_negative(q), 128.0, 0.0)
    sign = torch.where(_negative(y), 128.0, 0.0)
    # isinf / isnan as comparisons: inductor's CPU code does not vectorize them (1.5x on encode)
    code = torch.where((y.abs() == math.inf) & (c[INF_CODE] >= 0), c[INF_CODE] + sign, code)
    code = torch.where(q != q, c[NAN_CODE] + torch.where(_negative(q), c[NAN_SIGN], 0.0), code)
    return code.to(torch.uint8)


def _ordinal(w: torch.Tensor, scale: torch.Tensor, p: torch.Tensor, c: torch.Tensor, m0: bool,
             ftz: bool) -> torch.Tensor:
    q = round_nearest(w.to(torch.float32) * scale, p, m0, ftz)
    return torch.copysign(_magnitude(q.abs(), p, c), q)


def _count(mask: torch.Tensor) -> torch.Tensor:
    """True elements, summed in int32: inductor's CPU code widens each mask to two vectors of int64
    otherwise, which made the 8 counts of `_moves` cost a third of it. (Tensors < 2^31 elements.)"""
    return mask.sum(dtype=torch.int32)


def _moves(w_old: torch.Tensor, w_new: torch.Tensor, w_kept: torch.Tensor, scale: torch.Tensor, p: torch.Tensor,
           c: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    """int32 [elements, changed, stalled, then how many moved >= each of _MOVE_EDGES codes]: changed
    where w_new != w_old, the codes moved from w_old's to w_kept's (w_new itself, or what is kept of
    it: `code_moves_all`)."""
    distance = (_ordinal(w_kept, scale, p, c, m0, ftz) - _ordinal(w_old, scale, p, c, m0, ftz)).abs()
    changed = w_new != w_old
    at_least = [_count(distance >= edge) for edge in _MOVE_EDGES]
    elements = torch.full((), w_old.numel(), dtype=torch.int32, device=w_old.device)
    return torch.stack([elements, _count(changed), _count(changed & (distance == 0)), *at_least])


def _moves_all(w_olds: list[torch.Tensor], w_news: list[torch.Tensor], w_kepts: list[torch.Tensor],
               scales: torch.Tensor, p: torch.Tensor, c: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    return torch.stack([_moves(a.reshape(-1), b.reshape(-1), k.reshape(-1), scales[i], p, c, m0, ftz)
                        for i, (a, b, k) in enumerate(zip(w_olds, w_news, w_kepts, strict=True))])


CODE_COUNT = 256
COUNTED = 3 + CODE_COUNT  # what `quantization_counts` returns: overflow, underflow, elements, histogram


# A sample of more codes than this is histogrammed by `bincount` when on the CPU; fewer, by a
# scatter inside the compiled kernel (docs/design.md, on the quantizer counters).
BINCOUNT_MIN_CODES = 8192


def code_histogram(codes: torch.Tensor) -> torch.Tensor:
    """int32 [CODE_COUNT]: how many of the uint8 `codes` sit on each code.

    Compiled, the scatter is an atomic add per element; on the CPU the threads contend for the 256
    bins, so a large sample goes to `cpu_bincount` instead, an operator the kernel calls. That call
    costs more than a small sample's scatter, and on a GPU atomics are cheap (and `bincount` there
    reads its output size back to the host: a sync)."""
    if codes.device.type == "cpu" and codes.numel() > BINCOUNT_MIN_CODES:
        return cpu_bincount(codes)
    codes = codes.to(torch.int64)
    return torch.zeros(CODE_COUNT, dtype=torch.int32, device=codes.device).index_add_(
        0, codes, torch.ones_like(codes, dtype=torch.int32))


@torch.library.custom_op("altgrad::cpu_bincount", mutates_args=(), device_types="cpu")
def cpu_bincount(codes: torch.Tensor) -> torch.Tensor:
    """`bincount` of uint8 codes as int32 [CODE_COUNT]: an operator of its own, so that a compiled
    kernel calls it (its output size is fixed here; `bincount`'s own depends on the values)."""
    return torch.bincount(codes, minlength=CODE_COUNT).to(torch.int32)


@cpu_bincount.register_fake
def _cpu_bincount_shape(codes: torch.Tensor) -> torch.Tensor:
    return codes.new_empty(CODE_COUNT, dtype=torch.int32)


def quantization_counts(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, p: torch.Tensor,
                        c: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    """int32 [COUNTED]: overflow (|x * s| > max, inf included), underflow (x != 0 that became 0),
    elements, then how many elements of q sit on each of the 256 codes, for q = quantize(x) under
    scale s (any shapes, x and q alike). Integer sums, so a compiled kernel counts exactly what eager
    does. A kernel function: the training step counts inside its own compiled call."""
    x, q = x.reshape(-1), q.reshape(-1)
    overflow = _count((x.to(torch.float32) * scale).abs() > p[MAX])
    underflow = _count((x != 0) & (q == 0))
    histogram = code_histogram(_encode(q, scale, p, c, m0, ftz))
    return torch.cat([torch.stack([overflow, underflow, torch.full_like(overflow, x.numel())]), histogram])


def _encode_samples(xs: list[torch.Tensor], samples: list[torch.Tensor], scales: torch.Tensor,
                    p: torch.Tensor, c: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    # float32 x * s is the product that encode(x, fmt, s) rounds
    scaled = torch.cat([x.reshape(-1)[i].to(torch.float32) * scales[k]
                        for k, (x, i) in enumerate(zip(xs, samples, strict=True))])
    return _encode(scaled, scaled.new_ones(()), p, c, m0, ftz)


_ENCODE = Kernel(_encode)
# Called on a run's layers at every diagnostic step, with the same shapes: static (`Kernel`).
_ENCODE_SAMPLES = Kernel(_encode_samples, static_shapes=True)
_MOVES = Kernel(_moves_all, static_shapes=True)


def encode(x: torch.Tensor, fmt: str | FormatSpec, scale: Scale = None) -> torch.Tensor:
    """uint8 codes of quantize(x * s), round-to-nearest-even, finite overflow saturating.

    ±inf becomes the inf code ('ieee'), the NaN code ('fn', as ml_dtypes casts) or ±max ('none');
    NaN becomes the NaN code with its sign, or +0 in a 'none' format, which has no NaN (so a code
    histogram counts it as a zero).
    """
    fmt = get_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"encode expects a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    p = grid_params(fmt, True, torch.float32, x.device)
    s = scale_tensor(scale, torch.float32, x.device)
    with torch.no_grad():
        codes = _ENCODE(x.reshape(-1).detach(), s, p, code_params(fmt, x.device), *family(fmt))
    return codes.view(x.shape)


def encode_samples(xs: list[torch.Tensor], samples: list[torch.Tensor], fmt: str | FormatSpec,
                   scales: list[Scale]) -> list[torch.Tensor]:
    """`encode(x.flatten()[i], fmt, s)` for each tensor x, its int64 indices i and its scale s, in
    one compiled call: the per-tensor gathers and products would be a few small ops each."""
    fmt = get_format(fmt)
    device = xs[0].device
    s = scale_tensors(scales, torch.float32, device)
    with torch.no_grad():
        codes = _ENCODE_SAMPLES(list(xs), samples, s,
                                grid_params(fmt, True, torch.float32, device), code_params(fmt, device), *family(fmt))
    return list(codes.split([len(i) for i in samples]))


def decode(codes: torch.Tensor, fmt: str | FormatSpec) -> torch.Tensor:
    """uint8 codes -> float32 values of fmt (NaN codes -> NaN, inf codes -> ±inf)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode expects uint8 codes, got {codes.dtype}")
    return decode_table(get_format(fmt), codes.device)[codes.long()]


@cache
def decode_table(fmt: FormatSpec, device: torch.device) -> torch.Tensor:
    """float32 value of each of fmt's 256 codes: one table per format and device, so decode never
    copies it host-to-device."""
    return torch.tensor([fmt.value_of(c) for c in range(256)], dtype=torch.float32, device=device)


def code_moves(w_old: torch.Tensor, w_new: torch.Tensor, fmt: str | FormatSpec,
               scale: Scale = None, kept: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """How a step moved each weight through fmt's codes (under scale s), in one pass, on device.

    Returns 0-dim `changed` (w_new != w_old), `stalled` (changed, yet quantize(w_new) ==
    quantize(w_old): the bit-stall of SPEC §2) and `histogram`, the count of weights per code
    distance bin of MOVE_BINS.

    `kept`: what is kept of w_new where that is not w_new itself -- weights stored in their
    format, re-quantized after the update, perhaps stochastically. The codes moved are then
    kept's: a weight stalled when its update was not zero and its stored code stayed put.
    """
    return {k: v[0] for k, v in code_moves_all([w_old], [w_new], fmt, [scale],
                                               None if kept is None else [kept]).items()}


def code_moves_all(w_olds: list[torch.Tensor], w_news: list[torch.Tensor], fmt: str | FormatSpec,
                   scales: list[Scale], kept: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """`code_moves` of many weights of one format (each with its own scale, and `kept` one per
    weight where given) in one compiled call (a call costs ~0.1-0.3 ms of host time): `changed` and
    `stalled` [n], `histogram` [n, bins]."""
    fmt = get_format(fmt)
    kept = list(w_news) if kept is None else list(kept)
    for w_old, w_new, w_kept in zip(w_olds, w_news, kept, strict=True):
        if not w_old.shape == w_new.shape == w_kept.shape:
            shapes = " vs ".join(str(tuple(w.shape)) for w in (w_old, w_new, w_kept))
            raise ValueError(f"code_moves: shapes differ (old, new, kept), {shapes}")
    device = w_olds[0].device
    p = grid_params(fmt, True, torch.float32, device)
    s = scale_tensors(scales, torch.float32, device)
    with torch.no_grad():
        counts = _MOVES(list(w_olds), list(w_news), kept, s, p,
                        code_params(fmt, device), *family(fmt))
    at_least = torch.cat([counts[:, :1], counts[:, 3:], counts.new_zeros(len(w_olds), 1)], dim=1)
    return {"changed": counts[:, 1], "stalled": counts[:, 2], "histogram": at_least[:, :-1] - at_least[:, 1:]}
