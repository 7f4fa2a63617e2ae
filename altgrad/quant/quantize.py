"""The exact quantizer: round a float tensor onto a `FormatSpec`'s grid and back.

Method (no log2, no tables, no integer bit-casts in the hot loop): with P the container's mantissa
width (23 for float32) and e = floor(log2 |y|) clamped to the format's [emin, emax], build the
magic number 2^(e + P - mbits) exactly -- clamp |y| * 2^(P - mbits) to the format's binades, keep
its leading bit with a Veltkamp split, halve if that rounded up. Then (|y| + magic) - magic is |y|
rounded by the FPU to a multiple of the format's ULP 2^(e - mbits), ties to even: exact, and the
same ops in eager and in the inductor kernel (compiled with FP contraction and unsafe-math
reassociation pinned off, and on CUDA with IEEE division and subnormals kept). Only E?M0 needs a
fix-up: there the even *multiple* is not always the even *code* (1.5 * 2^e must go to whichever
of 2^e, 2^(e+1) has the even exponent field). Overflow then saturates or becomes inf/NaN, and the
sign is copied back, so -0 stays -0 and NaN propagates. Stochastic rounding uses the same ULP:
floor(|y| / ULP + U) * ULP.

Inputs are computed in float32 (float64 stays float64, so there is no double rounding); bf16/fp16
are widened exactly. Results are cast back to the input dtype: every 8-bit value fits bf16, but
fp16 cannot hold e6m1/e7m0's range. A scale s means quantize(x * s) / s in that precision.

The kernels are compiled lazily with `torch.compile(dynamic=True)`; one graph serves every format
of a family, because the format enters as a small parameter tensor, not as constants (E?M0 and
flush-to-zero formats, input dtypes and the rounding mode add graphs). If compiling fails, the
reason is kept (`compile_status`) and the eager version is used from then on;
ALTGRAD_NO_COMPILE=1 forces eager. Both are bit-identical.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from functools import cache
from typing import Literal

import torch

from altgrad.quant.formats import FormatSpec, get_format

Rounding = Literal["nearest", "stochastic"]
Scale = float | torch.Tensor | None

_MANTISSA_BITS = {torch.float32: 23, torch.float64: 52}


@cache
def _compile_options() -> dict[str, object]:
    """Inductor options under which a compiled kernel computes exactly what eager does, op by op:
    no FP contraction (an FMA breaks the Veltkamp split; `emulate_precision_casts` turns off
    Triton's fp fusion), IEEE division (Triton's `/` is approximate), subnormals kept; plus no
    wrapper asserts of every input's size, stride and alignment per call (dynamo's guards checked
    them; with a few dozen inputs they cost ~0.1 ms a call). Options this torch does not know are
    left out; tests/test_cuda.py checks the results bit for bit."""
    from torch._inductor import config

    wanted = {"cpp.enable_unsafe_math_opt_flag": False, "cpp.enable_floating_point_contract_flag": "off",
              "emulate_precision_casts": True, "eager_numerics.division_rounding": True,
              "eager_numerics.disable_ftz": True,
              "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
    known = config.get_config_copy()
    return {k: v for k, v in wanted.items() if k in known}


def _container(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@cache
def _params(fmt: FormatSpec, saturate: bool, dtype: torch.dtype, device: torch.device):
    """Format constants as one tensor, so one compiled graph serves every format.

    [0, 1] the clamp range of |y| * 2^(P - mbits): binades emin .. max(emax, emin) (E0 has one
    ULP everywhere); [2] 2^(P - mbits); [3] max; [4] what overflow becomes: max when saturating
    or without specials, else inf ('ieee') or NaN ('fn'); [5, 6] min_normal and the magic number
    below it when flushing subnormals; [7] 2^(bias - P), which maps an E?M0 magic number
    2^(e + P) to 2^(e + bias), e + bias being the code's exponent field.
    """
    mant = _MANTISSA_BITS[dtype]
    shift = mant - fmt.mbits
    overflow = fmt.max if saturate or fmt.specials == "none" else (
        math.inf if fmt.specials == "ieee" else math.nan)
    values = [math.ldexp(1.0, fmt.emin + shift), math.ldexp(1.0, max(fmt.emax, fmt.emin) + shift),
              math.ldexp(1.0, shift), fmt.max, overflow, fmt.min_normal,
              math.ldexp(1.0, fmt.emin + mant), math.ldexp(1.0, fmt.bias - mant)]
    return torch.tensor(values, dtype=dtype, device=device)


def _magic(a: torch.Tensor, p: torch.Tensor, ftz: bool) -> torch.Tensor:
    """2^(e + P - mbits) for |y| = a, e = floor(log2 a) clamped to the format."""
    s = torch.clamp(a * p[2], p[0], p[1])
    c = s * (2.0 ** _MANTISSA_BITS[a.dtype] + 1)
    hi = c - (c - s)  # s rounded to one significant bit: 2^E or 2^(E+1)
    magic = torch.where(hi > s, hi * 0.5, hi)
    if ftz:  # below min_normal the grid is {0, min_normal}
        magic = torch.where(a < p[5], p[6], magic)
    return magic


def _round(y: torch.Tensor, p: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    """y (float32/64) rounded to the nearest-even code, overflow handled, sign kept."""
    a = y.abs()
    magic = _magic(a, p, ftz)
    q = (a + magic) - magic
    if m0:  # a tie a = 1.5 * 2^e went up to the even multiple 2^(e+1); the even *code* wins
        # instead: 2^e when its exponent field e + bias is even, i.e. 2^(e + bias) has an exact
        # square root. (magic = 2^(e + P); below min_normal a < 2^emin is never such a tie.)
        field = magic * p[7]
        root = torch.sqrt(field)
        tie = a == magic * (1.5 * 2.0 ** -_MANTISSA_BITS[y.dtype])
        q = torch.where(tie & (root * root == field), q * 0.5, q)
    q = torch.where(q > p[3], p[4], q)
    return torch.copysign(q, y)


def _nearest(x: torch.Tensor, p: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    return _round(x.to(_container(x.dtype)), p, m0, ftz).to(x.dtype)


def _nearest_scaled(x: torch.Tensor, scale: torch.Tensor, p: torch.Tensor, m0: bool,
                    ftz: bool) -> torch.Tensor:
    return (_round(x.to(_container(x.dtype)) * scale, p, m0, ftz) / scale).to(x.dtype)


def _stochastic(x: torch.Tensor, scale: torch.Tensor, p: torch.Tensor, ftz: bool,
                noise: torch.Tensor) -> torch.Tensor:
    y = x.to(_container(x.dtype)) * scale
    a = y.abs()
    ulp = _magic(a, p, ftz) * 2.0 ** -_MANTISSA_BITS[y.dtype]
    q = torch.floor(a / ulp + noise) * ulp
    q = torch.where(q > p[3], p[4], q)
    return (torch.copysign(q, y) / scale).to(x.dtype)


_GRAPHS_PER_KERNEL = 64


class _Kernel:
    """A pointwise kernel, compiled on first use; eager when compiling is off or has failed."""

    registry: list[_Kernel] = []  # every kernel, for `compile_status`

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn
        self.compiled: Callable[..., torch.Tensor] | None = None
        self.error: str | None = None
        _Kernel.registry.append(self)

    def __call__(self, x: torch.Tensor | list[torch.Tensor], *args) -> torch.Tensor:
        """fn(x, *args). x (a tensor, or a non-empty list of them for one call over many) decides
        whether to compile (tensors of 0/1 elements are not) and which device's autocast to leave."""
        first = x[0] if isinstance(x, list) else x
        # 0/1-element tensors would each specialise a new graph; they are not worth compiling.
        if (self.error is None and (first is not x or x.numel() > 1)
                and os.environ.get("ALTGRAD_NO_COMPILE") != "1"):
            try:
                if self.compiled is None:
                    # A kernel has one graph per format family (m0, ftz) x dtype x rounding x
                    # sampled-or-whole input: more than dynamo's default of 8, past which it fails.
                    # The limit is process-wide (dynamo has no per-function one); it only grows.
                    dynamo = torch._dynamo.config  # (named cache_size_limit before torch 2.6)
                    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
                    setattr(dynamo, name, max(getattr(dynamo, name), _GRAPHS_PER_KERNEL))
                    self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True,
                                                  options=_compile_options())
                # Autocast is part of a graph's guards: called from both forward (autocast on) and
                # backward (off), each kernel would compile twice and soon hit the recompile limit.
                if torch.is_autocast_enabled(first.device.type):
                    with torch.autocast(first.device.type, enabled=False):
                        return self.compiled(x, *args)
                return self.compiled(x, *args)
            except Exception as err:  # noqa: BLE001 - any compiler failure means: use eager
                self.error = f"{type(err).__name__}: {err}".splitlines()[0]
                warnings.warn(f"altgrad quantizer: torch.compile failed, using eager ({self.error})",
                              RuntimeWarning, stacklevel=3)
        return self.fn(x, *args)


_NEAREST = _Kernel(_nearest)
_NEAREST_SCALED = _Kernel(_nearest_scaled)
_STOCHASTIC = _Kernel(_stochastic)


def compile_status() -> str:
    """'compiled', 'eager (ALTGRAD_NO_COMPILE=1)' or 'eager (<why compiling failed>)'."""
    if os.environ.get("ALTGRAD_NO_COMPILE") == "1":
        return "eager (ALTGRAD_NO_COMPILE=1)"
    errors = [k.error for k in _Kernel.registry if k.error]
    return f"eager ({errors[0]})" if errors else "compiled"


@cache
def _one(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=dtype, device=device)


def _scale_tensor(scale: Scale, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Validate the scale and make it a 0-dim tensor of the compute dtype.

    Python numbers and CPU tensors are checked here (ValueError). A scale on an accelerator is
    checked with an asynchronous device assert instead, so the hot path never waits on the host.
    """
    if scale is None:
        return _one(dtype, device)
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError(f"scale must be a single float, got shape {tuple(scale.shape)} "
                             f"{scale.dtype}")
        s = scale.detach().reshape(()).to(device=device, dtype=dtype)
        if s.device.type == "cpu" and not torch.compiler.is_compiling():
            if not 0 < s.item() < math.inf:  # NaN fails too
                raise ValueError(f"scale must be finite and > 0, got {s.item()}")
        else:
            torch._assert_async((s > 0) & (s < math.inf), "altgrad quantize: scale must be finite and > 0")
        return s
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a float or a tensor, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return torch.full((), scale, dtype=dtype, device=device)


def rounding_noise(flat: torch.Tensor, rounding: Rounding,
                   generator: torch.Generator | None = None) -> torch.Tensor | None:
    """U[0, 1) per element of `flat` for stochastic rounding (container dtype), None for nearest."""
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "nearest":
        return None
    return torch.rand(flat.shape, generator=generator, dtype=_container(flat.dtype), device=flat.device)


def quantize(x: torch.Tensor, fmt: str | FormatSpec, scale: Scale = None,
             rounding: Rounding = "nearest", saturate: bool = True,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Round x onto fmt's grid and return the (dequantized) values, same dtype and shape.

    With `scale` s: quantize(x * s) / s. `saturate=False` lets overflow become inf ('ieee') or NaN
    ('fn'); 'none' formats have neither and always saturate. Stochastic rounding takes
    floor(|t| + U), U ~ U[0, 1) from `generator`, with t = |x * s| / ULP: unbiased up to float
    rounding of t + U. Not differentiable (see `fake_quantize`).
    """
    fmt = get_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    dtype = _container(x.dtype)
    p = _params(fmt, bool(saturate), dtype, x.device)
    flat, ftz = x.reshape(-1).detach(), not fmt.subnormals  # detach last: no `_base` for dynamo to guard on
    noise = rounding_noise(flat, rounding, generator)
    with torch.no_grad():
        if noise is not None:
            out = _STOCHASTIC(flat, _scale_tensor(scale, dtype, x.device), p, ftz, noise)
        elif scale is None:
            out = _NEAREST(flat, p, fmt.mbits == 0, ftz)
        else:
            out = _NEAREST_SCALED(flat, _scale_tensor(scale, dtype, x.device), p, fmt.mbits == 0, ftz)
    return out.view(x.shape)


class _StraightThrough(torch.autograd.Function):
    """Forward returns q = quantize(x); backward passes the gradient to x unchanged (STE), or, with
    `clip_ste`, zeroed where |x * s| > fmt.max, i.e. where the forward saturated."""

    @staticmethod
    def forward(ctx, x, quantized, fmt, scale, clip_ste):
        # quantized = (q,): inside a tuple q is not an input of the Function, so q itself becomes
        # the output (a view of an input would be, and autograd refuses in-place ops on those).
        ctx.fmt, ctx.clip_ste = fmt, clip_ste
        if clip_ste:
            ctx.save_for_backward(x, scale if isinstance(scale, torch.Tensor) else None)
            ctx.py_scale = None if isinstance(scale, torch.Tensor) else scale
        return quantized[0]

    @staticmethod
    def backward(ctx, grad):
        if ctx.clip_ste:
            x, tscale = ctx.saved_tensors
            scale = tscale if tscale is not None else ctx.py_scale
            y = x.to(_container(x.dtype))
            if scale is not None:
                y = y * scale
            grad = grad.masked_fill(y.abs() > ctx.fmt.max, 0)
        return grad, None, None, None, None


def straight_through(x: torch.Tensor, q: torch.Tensor, fmt: FormatSpec, scale: Scale = None,
                     clip_ste: bool = False) -> torch.Tensor:
    """q (already quantize(x, fmt, scale)) in forward, x's gradient in backward: the STE."""
    return _StraightThrough.apply(x, (q.detach(),), fmt, scale, clip_ste)


def fake_quantize(x: torch.Tensor, fmt: str | FormatSpec, scale: Scale = None,
                  rounding: Rounding = "nearest", clip_ste: bool = False,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """quantize() in forward, identity gradient in backward (STE).

    With `clip_ste` the gradient is zeroed where |x * s| > fmt.max, i.e. where the forward
    saturated, as in PACT/LSQ-style clipped estimators.
    """
    fmt = get_format(fmt)
    return straight_through(x, quantize(x, fmt, scale, rounding, generator=generator), fmt, scale, clip_ste)
