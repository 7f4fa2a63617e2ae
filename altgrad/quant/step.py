"""What a training step does to one quantized tensor: scale and quantize in one call, then count.

A `QuantizedLinear` quantizes three tensors per step. Done one by one (scaler update, scale check,
quantizer) that was ~30 kernel launches and two compiled calls per tensor, so a GPU step at the gpu
preset spent most of its time launching kernels (7x a bf16 step). `quantize_step` runs the same
functions, in the same order, as one compiled graph after an eager `aminmax` (see
`scaling._scale_step`), so its results are bit-identical to the separate calls:
`tests/test_quantized_linear.py` compares them. The counters stay a separate call: fused into the
same graph, inductor's code for the sampled counts over a 25M-element logits gradient cost 12x the
separate kernel on CPU.

The counters (`TensorStats`) see at most STATS_SAMPLE elements of a tensor: smaller tensors are
counted exactly; larger ones (the logits gradient has B * T * vocab elements) on STATS_RUNS evenly
spaced runs of contiguous elements, which estimates the rates without bias for a fraction of the
cost (contiguous runs, not a stride: one element per cache line over 100 MB costs more than
counting them all).
"""

from __future__ import annotations

import torch
from torch import nn

from altgrad.quant.codes import code_histogram, quantizer_counts
from altgrad.quant.formats import FormatSpec
from altgrad.quant.quantize import (
    Rounding,
    _container,
    _Kernel,
    _nearest_scaled,
    _params,
    _stochastic,
    rounding_noise,
)
from altgrad.quant.scaling import TensorScaler, _scale_step

STATS_SAMPLE = 1 << 16
STATS_RUNS = 64


def sample(x: torch.Tensor) -> torch.Tensor:
    """x itself up to STATS_SAMPLE elements, else STATS_RUNS evenly spaced contiguous runs (a view)."""
    flat = x.detach().reshape(-1)
    if flat.numel() <= STATS_SAMPLE:
        return flat
    period = flat.numel() // STATS_RUNS
    return flat[:STATS_RUNS * period].view(STATS_RUNS, period)[:, :STATS_SAMPLE // STATS_RUNS]


class TensorStats(nn.Module):
    """On-device counters for one quantized tensor: overflow, underflow, elements, histogram."""

    def __init__(self):
        super().__init__()
        self.register_buffer("counts", torch.zeros(3), persistent=False)  # overflow, underflow, n
        self.register_buffer("histogram", torch.zeros(256), persistent=False)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, q: torch.Tensor, fmt: FormatSpec, scale: torch.Tensor) -> None:
        """Count overflow (|x * s| > max, inf included: it saturates), underflow (x != 0 that
        quantized to 0) and the codes of q = quantize(x, fmt, scale), over `sample`s of both."""
        x, q = sample(x), sample(q)
        counts, codes = quantizer_counts(x, q, fmt, scale)
        self.counts += torch.cat([counts, counts.new_full((1,), x.numel())])
        self.histogram += code_histogram(codes.reshape(-1))

    def reset(self) -> None:
        self.counts.zero_()
        self.histogram.zero_()


def _step(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, history: torch.Tensor,
          scale: torch.Tensor, last_amax: torch.Tensor, sp: torch.Tensor, p: torch.Tensor, m0: bool,
          ftz: bool, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """scaler.update(x), then quantize(x, scale), as one graph (x flat; lo, hi = aminmax(x))."""
    s = _scale_step(history, lo, hi, scale, last_amax, sp)
    q = _nearest_scaled(x, s, p, m0, ftz) if noise is None else _stochastic(x, s, p, ftz, noise)
    return q, s


_STEP = _Kernel(_step)


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
                 _params(fmt, True, _container(x.dtype), x.device), fmt.mbits == 0, not fmt.subnormals,
                 noise)
    return q.view(x.shape), s
