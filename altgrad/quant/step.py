"""What a training step does to one quantized tensor: scale and quantize in one call, then count.

A `QuantizedLinear` quantizes three tensors per step. Done one by one (scaler update, scale check,
quantizer) that was ~30 kernel launches and two compiled calls per tensor, so a GPU step at the gpu
preset spent most of its time launching kernels (7x a bf16 step). `quantize_step` runs the same
functions, in the same order, as one compiled graph after an eager `aminmax` (see
`scaling.scale_step`), so its results are bit-identical to the separate calls:
`tests/test_linear.py` compares them. The counters stay out of that graph (fused into
it, inductor's code for the sampled counts over a 25M-element logits gradient cost 12x a separate
kernel on CPU): `TensorStats` keeps copies of the samples, and `observed_counts` counts every
tensor of a step at once.

The counters (`TensorStats`) see at most STATS_SAMPLE elements of a tensor: smaller tensors are
counted exactly; larger ones (the logits gradient has B * T * vocab elements) on STATS_RUNS evenly
spaced runs of contiguous elements, which estimates the rates without bias for a fraction of the
cost (contiguous runs, not a stride: one element per cache line over 100 MB costs more than
counting them all).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from typing import NamedTuple

import torch
from torch import nn

from altgrad.quant.codes import code_histogram, quantizer_counts
from altgrad.quant.formats import FormatSpec
from altgrad.quant.kernels import Kernel, container_dtype, grid_params, nearest_scaled, stochastic
from altgrad.quant.quantize import Rounding, rounding_noise
from altgrad.quant.scaling import TensorScaler, scale_step

STATS_SAMPLE = 1 << 16
STATS_RUNS = 64


def sample(x: torch.Tensor) -> torch.Tensor:
    """x itself up to STATS_SAMPLE elements, else STATS_RUNS evenly spaced contiguous runs (a view)."""
    flat = x.detach().reshape(-1)
    if flat.numel() <= STATS_SAMPLE:
        return flat
    period = flat.numel() // STATS_RUNS
    return flat[:STATS_RUNS * period].view(STATS_RUNS, period)[:, :STATS_SAMPLE // STATS_RUNS]


class Observation(NamedTuple):
    """One quantization a TensorStats saw: samples of x and of q = quantize(x, fmt, scale)."""

    x: torch.Tensor
    q: torch.Tensor
    fmt: FormatSpec
    scale: torch.Tensor


class TensorStats(nn.Module):
    """What quantizing one tensor role did since `reset`: overflow, underflow, elements, histogram.

    `observe` keeps a copy of the `sample`s of x and q (and the scale); `observed_counts` counts
    every TensorStats' copies at once, one compiled call per format. Counted at each observation,
    a step made one compiled call and ~5 eager ops per quantized tensor: ~0.7 ms of host time each,
    27 a step at the cpu preset and 147 at the gpu one. A tensor quantized in backward (grad_output)
    is `reserve`d in forward and `fill`ed in backward instead."""

    def __init__(self, deferred: bool = False):
        super().__init__()
        self.observed: list[Observation] = []
        self.reserved: tuple[tuple[int, ...], FormatSpec] | None = None  # (sample shape, format)
        # Room for the one observation a step makes in backward (`reserve`, `fill`): x's and q's
        # samples and the scale. A buffer allocated with the module, written only in backward: in
        # a step graph an autograd.Function's backward may write a tensor the graph was given, not
        # one its forward made or wrote or returned a view of.
        self.register_buffer("room", torch.zeros(2, STATS_SAMPLE + 1) if deferred else torch.zeros(0),
                             persistent=False)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, q: torch.Tensor, fmt: FormatSpec, scale: torch.Tensor) -> None:
        """Keep x and q = quantize(x, fmt, scale), sampled (copies: the tensors themselves, such as
        the logits gradient, must not outlive their use)."""
        self.observed.append(Observation(sample(x).clone(), sample(q).clone(), fmt, scale.detach().clone()))

    def reserve(self, like: torch.Tensor, fmt: FormatSpec) -> None:
        """Announce an observation of a tensor shaped like `like`, made later by `fill` (grad_output
        is quantized in backward, which must not touch Python state when traced into a step
        graph). One per `reset`: it lives in `room`."""
        if self.room.numel() == 0 or self.reserved is not None:
            raise RuntimeError("TensorStats.reserve needs TensorStats(deferred=True), once per reset")
        self.reserved = (tuple(sample(like).shape), fmt)  # (a view: nothing is copied)

    @torch.no_grad()
    def fill(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Make the reserved observation of x and q = quantize(x, fmt, scale)."""
        xs, qs = sample(x), sample(q)
        self.room[0, :xs.numel()].view(xs.shape).copy_(xs)
        self.room[1, :qs.numel()].view(qs.shape).copy_(qs)
        self.room[0, STATS_SAMPLE].copy_(scale.reshape(()))

    def observations(self) -> list[Observation]:
        """Everything observed since `reset`, the reserved observation last."""
        if self.reserved is None:
            return list(self.observed)
        shape, fmt = self.reserved
        n = math.prod(shape)
        return [*self.observed, Observation(self.room[0, :n].view(shape), self.room[1, :n].view(shape), fmt,
                                            self.room[0, STATS_SAMPLE])]

    def reset(self) -> None:
        self.observed.clear()
        self.reserved = None

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(overflow, underflow, elements) and the 256-code histogram of this tensor's observations."""
        counts, histogram = observed_counts([self])
        return counts[0], histogram[0]


def observed_counts(stats: Sequence[TensorStats],
                    device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [len(stats), 3] overflow, underflow and elements, and int64 [len(stats), 256] code
    histograms, of everything each TensorStats observed since its reset: one compiled call per
    format and one histogram over all (each tensor's codes offset by 256 x its row)."""
    by_format: dict[FormatSpec, list[tuple[int, Observation]]] = {}
    for row, s in enumerate(stats):
        for seen in s.observations():
            by_format.setdefault(seen.fmt, []).append((row, seen))
    if device is None:
        device = next((seen.x.device for items in by_format.values() for _, seen in items), torch.device("cpu"))
    counts = torch.zeros(len(stats), 3, device=device)
    codes = []
    for fmt, items in by_format.items():
        rows, seen = zip(*items, strict=True)
        index, offsets = _indices(rows, device)
        n, c = quantizer_counts([o.x for o in seen], [o.q for o in seen], fmt, [o.scale for o in seen], offsets)
        counts.index_add_(0, index, n.float())
        codes.append(c)
    bins = 256 * len(stats)
    histogram = code_histogram(torch.cat(codes), bins) if codes else torch.zeros(bins, dtype=torch.int64, device=device)
    return counts, histogram.view(len(stats), 256)


@cache
def _indices(rows: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows as an index and as code offsets (256 x row), on the device: made once per pattern
    (a run has a few, one per format), not copied to the device every step."""
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor([256 * r for r in rows], dtype=torch.int32, device=device))


def _step(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, history: torch.Tensor,
          scale: torch.Tensor, last_amax: torch.Tensor, sp: torch.Tensor, p: torch.Tensor, m0: bool,
          ftz: bool, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """scaler.update(x), then quantize(x, scale), as one graph (x flat; lo, hi = aminmax(x))."""
    s = scale_step(history, lo, hi, scale, last_amax, sp)
    q = nearest_scaled(x, s, p, m0, ftz) if noise is None else stochastic(x, s, p, ftz, noise)
    return q, s


_STEP = Kernel(_step)


@torch.no_grad()
def quantize_step(x: torch.Tensor, fmt: FormatSpec, scaler: TensorScaler,
                  rounding: Rounding = "nearest") -> tuple[torch.Tensor, torch.Tensor]:
    """A training step's quantization of x: advance `scaler` on x and quantize x with the scale it
    returns. Returns (q, scale), as `scaler.update` and `quantize` would one after the other."""
    flat = x.reshape(-1).detach()  # detach last: no `_base` for dynamo to guard on
    noise = rounding_noise(flat, rounding)
    if not x.numel():  # the scaler records amax 0; nothing to quantize
        return x.detach().clone(), scaler.update(x)
    lo, hi = torch.aminmax(flat)
    q, s = _STEP(flat, lo, hi, scaler.amax_history, scaler.scale, scaler.amax, scaler.step_params(),
                 grid_params(fmt, True, container_dtype(x.dtype), x.device), fmt.mbits == 0, not fmt.subnormals,
                 noise)
    return q.view(x.shape), s
