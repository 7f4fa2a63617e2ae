"""What a training step does to one quantized tensor: scale, quantize and count, in one call.

A `QuantizedLinear` quantizes three tensors per step. `quantize_step` runs the scaler's update and
the quantizer -- the same functions `TensorScaler.update` and `quantize` run (the state written
last), so the results are bit-identical (`tests/test_linear.py`) -- as one compiled call, and on diagnostic
steps the counters too (`TensorStats`), so a diagnostic step makes no call of its own per tensor.
Traced into a step graph (`kernels.StepGraph`) all of it is lowered into that graph's fused loops.

The counters see at most STATS_SAMPLE elements of a tensor: smaller tensors are counted exactly;
larger ones (the logits gradient has B * T * vocab elements) on one run of contiguous elements in
each STATS_RUNS-th of the tensor, from an offset in it fixed per size (a stratified sample:
contiguous runs, not a stride, because one element per cache line over 100 MB costs more than
counting them all; offsets drawn, not each run at its stratum's start, because a tensor's rows line
up with its strata: the logits gradient's 64 strata all began at vocab id 0, and the sample saw
only ids below 1024, whose gradients are not the rest's). A sample's overflow and underflow counts
are scaled up to the whole tensor (`whole_tensor_counts`), so that rates summed over tensors weigh
each by its size, not by its sample's.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from altgrad.quant.codes import COUNTED, code_params, quantization_counts
from altgrad.quant.formats import FormatSpec
from altgrad.quant.kernels import (
    Constants,
    Kernel,
    container_dtype,
    family,
    grid_params,
    nearest_scaled,
    stochastic,
)
from altgrad.quant.quantize import Rounding, rounding_noise
from altgrad.quant.scaling import TensorScaler, abs_max, amax_of, next_scale, record_step

STATS_SAMPLE = 1 << 16
STATS_RUNS = 64
# Each run's offset in its stratum: a Weyl sequence (i * 2^32 / golden ratio, modulo the stratum's
# length) spreads the runs over the columns of whatever row length the strata line up with.
_OFFSET_STEP, _OFFSET_START = 2654435769, 12345


def sample(x: torch.Tensor) -> torch.Tensor:
    """x itself (flat) up to STATS_SAMPLE elements, else STATS_RUNS runs of STATS_SAMPLE / STATS_RUNS
    contiguous elements, one in each STATS_RUNS-th of x from an offset fixed for x's size (spread
    over the strata by the Weyl sequence, not random: the same positions every step) and wrapping
    around to that stratum's start, gathered into a flat tensor. The last numel % STATS_RUNS
    elements are never in it."""
    flat = x.detach().reshape(-1)
    if flat.numel() <= STATS_SAMPLE:
        return flat
    run, period = STATS_SAMPLE // STATS_RUNS, flat.numel() // STATS_RUNS
    stratum = torch.arange(STATS_RUNS, device=flat.device)[:, None]
    within = (stratum * _OFFSET_STEP + _OFFSET_START) % period + torch.arange(run, device=flat.device)
    within = torch.where(within < period, within, within - period)  # (a modulo per element costs a division)
    return flat[(stratum * period + within).reshape(-1)]


def whole_tensor_counts(counts: torch.Tensor, numel: int) -> torch.Tensor:
    """`quantization_counts` of a tensor's sample (int32) as int64 counts of the whole tensor of
    `numel` elements: overflow and underflow scaled by numel / elements sampled (floored; exact
    for a tensor counted whole), elements = numel; the code histogram stays the sample's (which
    codes occur). int64: a diagnostic step sums over its micro-batches up to billions of elements."""
    counts = counts.long()
    if numel <= STATS_SAMPLE:  # counted whole
        return counts
    estimated = counts[:2] * numel // counts[2].clamp_min(1)
    return torch.cat([estimated, counts.new_full((1,), numel), counts[3:]])


class TensorStats(nn.Module):
    """What quantizing one tensor role did since `reset`: overflow, underflow, elements and the
    256-code histogram, summed over its quantizations in one int64 buffer (`codes.COUNTED` long;
    overflow, underflow and elements of the whole tensor, the histogram of its sample).
    A training step counts inside its quantizing call (`quantize_step(..., stats=)`); `observe`
    counts a quantization made elsewhere. The buffer is written in place, also from backward
    (grad_output), so a step graph returns it like any other buffer it updates."""

    def __init__(self):
        super().__init__()
        self.register_buffer("counted", torch.zeros(COUNTED, dtype=torch.int64), persistent=False)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, q: torch.Tensor, fmt: FormatSpec, scale: torch.Tensor) -> None:
        """Count x and q = quantize(x, fmt, scale), sampled."""
        p = grid_params(fmt, True, torch.float32, x.device)
        # the sample gathered before the compiled call (docs/design.md, the quantizer counters)
        numel, x, q = x.numel(), sample(x), sample(q)
        counts = _COUNT(x, q, scale.detach().float(), p, code_params(fmt, x.device), *family(fmt))
        self.counted.add_(whole_tensor_counts(counts, numel))

    def reset(self) -> None:
        self.counted.zero_()

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(overflow, underflow, elements) and the 256-code histogram counted since `reset`."""
        return self.counted[:3], self.counted[3:]


_COUNT = Kernel(quantization_counts)


def _step(x: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None, scale_amax: torch.Tensor | None,
          state: torch.Tensor, sp: Constants, p: Constants, p32: Constants, c: Constants, m0: bool, ftz: bool,
          pow2: bool, noise: torch.Tensor | None,
          counted: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """scaler.update(x), then quantize(x, scale), then (given the `counted` so far) `counted` plus
    `quantization_counts` of the sample, as one graph (x flat). p is the grid in x's container
    dtype, p32 in float32, which the counters encode in. The sum is made here, not by the caller: in
    a step graph it is then fused with the counting, not an op of its own per tensor. `pow2`: the
    scaler's scales are powers of two (`kernels.unscale`).

    (lo, hi) = aminmax(x), reduced here where None. `scale_amax`: what the scale is computed from
    where it needs the tensor's own amax (`scaling.next_scale`), by default that amax. A caller that
    knows the scale needs none this step passes any value instead: then the quantizing does not wait
    for the reduction and inductor computes both in one loop over x -- provided the state is
    written after the quantizing, as here (written before it, a second loop)."""
    if lo is None or hi is None:
        lo, hi = torch.aminmax(x)
    amax = amax_of(lo, hi)
    s = next_scale(state, amax if scale_amax is None else scale_amax, sp)
    q = nearest_scaled(x, s, p, m0, ftz, pow2) if noise is None else stochastic(x, s, p, ftz, noise, pow2)
    if counted is not None:
        counted = counted + whole_tensor_counts(quantization_counts(sample(x), sample(q), s, p32, c, m0, ftz),
                                                x.numel())
    record_step(state, amax, s)
    return q, s, counted


def _step_in_graph(x: torch.Tensor, scaler: TensorScaler, noise: torch.Tensor | None,
                   counted: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`_step` as traced into a step graph, with everything a quantized tensor needs inside it: the
    amax, x's reshapes (x of any shape) and the format's constants (`kernels.constants`)."""
    q, s, counted = _step(x.reshape(-1), None, None, None, *_step_args(x, scaler), noise, counted)
    return q.view(x.shape), s, counted


def _step_args(x: torch.Tensor, scaler: TensorScaler) -> tuple:
    """What `_step` takes from the scaler and its format, for x: state, constants, family and
    whether the scales are powers of two."""
    fmt = scaler.fmt
    return (scaler.state, scaler.step_params(), grid_params(fmt, True, container_dtype(x.dtype), x.device),
            grid_params(fmt, True, torch.float32, x.device), code_params(fmt, x.device), *family(fmt),
            scaler.policy.pow2_scales)


_STEP = Kernel(_step)
_STEP_IN_GRAPH = Kernel(_step_in_graph)


@torch.no_grad()
def quantize_step(x: torch.Tensor, scaler: TensorScaler, rounding: Rounding = "nearest",
                  stats: TensorStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A training step's quantization of x: advance `scaler` on x and quantize x to the scaler's
    format with the scale it returns; count it into `stats` if given. Returns (q, scale), as
    `scaler.update`, `quantize` and `stats.observe` would one after the other.

    Traced into a step graph (static shapes) the whole of it, amax included, is lowered by inductor
    there (`kernels.Kernel`). Called on its own it is one compiled call. On the CPU, where reading
    the scaler's history costs no sync, the amax is reduced inside that call, in the same loop
    as the quantizing once the scale does not need it (`TensorScaler.scale_needs_amax`); where it
    does, an eager `abs_max` gives the scale its amax first. On an accelerator the call takes
    (lo, hi) from an eager `aminmax`: compiled with dynamic shapes, inductor cannot split the
    reduction (docs/design.md)."""
    flat = x.reshape(-1).detach()  # detach last: no `_base` for dynamo to guard on
    if not flat.numel():  # the scaler records amax 0; nothing to quantize or count
        return x.detach().clone(), scaler.update(x)
    noise, counted = rounding_noise(flat, rounding), None if stats is None else stats.counted
    if torch.compiler.is_compiling():
        q, s, counted = _STEP_IN_GRAPH(x.detach(), scaler, noise, counted)
    else:
        if flat.device.type == "cpu":  # (lo, hi, scale_amax) as `_step` takes them
            # Where the scale needs the amax, the call still reduces x again for the state: in the
            # loop that quantizes, nearly free, and the same graph serves every step.
            amaxes: tuple[torch.Tensor | None, ...] = (
                None, None, abs_max(flat) if scaler.scale_needs_amax() else _no_amax())
        else:
            amaxes = (*torch.aminmax(flat), None)
        q, s, counted = _STEP(flat, *amaxes, *_step_args(x, scaler), noise, counted)
        q = q.view(x.shape)
    if stats is not None:
        stats.counted.copy_(counted)
    return q, s


@cache
def _no_amax() -> torch.Tensor:
    """The `scale_amax` of a CPU step whose scale does not read it (any float32 would do)."""
    return torch.zeros((), dtype=torch.float32, device="cpu")
