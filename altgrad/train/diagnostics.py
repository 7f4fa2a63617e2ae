"""Per-layer numerical diagnostics, computed on the device as 0-dim tensors.

Nothing here calls `.item()`: the trainer stacks every tensor of a step and reads them in one
host sync. Layer names drop the `transformer.` prefix (`h.0.mlp.c_fc`, `lm_head`).
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from altgrad.quant.codes import code_moves
from altgrad.quant.convert import linear_layers
from altgrad.quant.formats import FormatSpec
from altgrad.quant.linear import ROLES, QuantizedLinear
from altgrad.quant.quantize import _Kernel, _nearest_scaled, _params
from altgrad.quant.scaling import abs_max, scale_for

Metrics = dict[str, torch.Tensor]


def short_name(name: str) -> str:
    return name.removeprefix("transformer.")


def kurtosis(x: torch.Tensor) -> torch.Tensor:
    """Excess-free (Pearson) kurtosis E[(x-mu)^4] / var^2 of all elements; 3 for a Gaussian."""
    x = x.detach().float().flatten()
    d = x - x.mean()
    var = d.square().mean()
    return d.square().square().mean() / var.square().clamp_min(1e-30)


def _gradient_stats(g: torch.Tensor, p: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    g = g.float()
    l2, linf = torch.linalg.vector_norm(g), abs_max(g)
    dead = 1 - torch.count_nonzero(g) / g.numel()
    s = scale_for(linf, p[3], True, torch.ones_like(linf))  # compute_scale(linf, fmt); p[3] = fmt.max
    noise = torch.linalg.vector_norm(g - _nearest_scaled(g, s, p, m0, ftz))
    snr = 20 * torch.log10(l2.clamp_min(1e-30) / noise.clamp_min(1e-30))
    return torch.stack([l2, linf, dead, snr])


_GRADIENT_STATS = _Kernel(_gradient_stats)
GRADIENT_STATS = ("l2", "linf", "dead_frac", "snr")


def gradient_stats(g: torch.Tensor, fmt: FormatSpec) -> torch.Tensor:
    """float32 [l2, linf, dead_frac, snr] of a gradient (GRADIENT_STATS), where snr is the SQNR
    (dB) of g under `fmt` with per-tensor amax scaling: how much the format would lose.

    One compiled call, two passes over g (five passes and ~20 eager ops before).
    """
    g = g.detach().reshape(-1)
    return _GRADIENT_STATS(g, _params(fmt, True, torch.float32, g.device), fmt.mbits == 0,
                           not fmt.subnormals)


@cache
def finite_code_count(fmt: FormatSpec) -> int:
    return int(torch.isfinite(fmt.decode(torch.arange(256, dtype=torch.uint8))).sum())


class Diagnostics:
    """Gradient, activation, quantizer and bit-stall metrics of one training step."""

    def __init__(self, model: nn.Module, grad_format: FormatSpec):
        self.linears: dict[str, nn.Linear] = {
            short_name(n): model.get_submodule(n) for n in linear_layers(model)
        }
        self.quantized = {n: m for n, m in self.linears.items() if isinstance(m, QuantizedLinear)}
        self.grad_format = grad_format
        self._kurtosis: Metrics = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    # -- forward: activation kurtosis and quantizer counters --------------------------------
    def begin(self) -> None:
        for layer in self.quantized.values():
            layer.collect_stats = True
            for stats in layer.stats.values():
                stats.reset()
        for name, layer in self.linears.items():
            self._hooks.append(layer.register_forward_pre_hook(self._kurtosis_hook(name)))

    def _kurtosis_hook(self, name: str):
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self._kurtosis[name] = kurtosis(args[0])

        return hook

    def end(self) -> None:
        for layer in self.quantized.values():
            layer.collect_stats = False
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._kurtosis = {}

    def activation_metrics(self) -> Metrics:
        out = {f"act/kurtosis/{n}": k for n, k in self._kurtosis.items()}
        if self._kurtosis:
            out["act/kurtosis_max"] = torch.stack(list(self._kurtosis.values())).max()
        return out

    # -- backward: gradient statistics (before clipping) ---------------------------------
    def gradient_metrics(self) -> Metrics:
        out: Metrics = {}
        for name, layer in self.linears.items():
            g = layer.weight.grad
            if g is None:
                continue
            stats = gradient_stats(g, self.grad_format)
            out.update({f"grad/{stat}/{name}": v for stat, v in zip(GRADIENT_STATS, stats, strict=True)})
        return out

    # -- quantizer counters ------------------------------------------------------------
    def quant_metrics(self) -> Metrics:
        """Overflow / underflow rates and code-range utilisation, per layer and model-wide."""
        zero = torch.zeros((), device=self._device())
        totals = torch.zeros(3, device=self._device())  # overflow, underflow, elements
        used = []
        out: Metrics = {}
        for name, layer in self.quantized.items():
            counts = sum(layer.stats[r].counts for r in ROLES)
            totals = totals + counts
            n = counts[2].clamp_min(1)
            out[f"quant/overflow_rate/{name}"] = counts[0] / n
            out[f"quant/underflow_rate/{name}"] = counts[1] / n
            layer_used = torch.stack([
                (layer.stats[r].histogram > 0).sum() / finite_code_count(layer.policy.format_of(r))
                for r in ROLES
            ]).mean()
            out[f"quant/codes_used/{name}"] = layer_used
            used.append(layer_used)
        n = totals[2].clamp_min(1)
        out["quant/overflow_rate"] = totals[0] / n
        out["quant/underflow_rate"] = totals[1] / n
        out["quant/codes_used"] = torch.stack(used).mean() if used else zero
        return out

    # -- optimizer: bit-stall on the weights each quantized layer stores ---------------------
    def snapshot(self) -> dict[str, torch.Tensor]:
        """Weights before the optimizer step (all linears; the baseline measures zero updates)."""
        return {n: m.weight.detach().clone() for n, m in self.linears.items()}

    def update_metrics(self, before: dict[str, torch.Tensor]) -> tuple[Metrics, dict[str, torch.Tensor]]:
        """Bit-stall over the quantized layers' moved weights; zero-update fraction over all.

        Also returns each quantized layer's code-move histogram (`code_moves`), for bit tracking.
        """
        out: Metrics = {}
        histograms: dict[str, torch.Tensor] = {}
        dev = self._device()
        stalled_total, moved_q, moved_all, elements = (torch.zeros((), device=dev) for _ in range(4))
        for name, w_old in before.items():
            w_new = self.linears[name].weight.detach()
            if name in self.quantized:
                layer = self.quantized[name]
                moves = code_moves(w_old, w_new, layer.policy.weight, layer.scalers["weight"].scale)
                moved = moves["changed"]
                out[f"quant/bit_stall_rate/{name}"] = moves["stalled"] / moved.clamp_min(1)
                stalled_total = stalled_total + moves["stalled"]
                moved_q = moved_q + moved
                histograms[name] = moves["histogram"]
            else:
                moved = torch.count_nonzero(w_new - w_old)  # (finite weights: w_new != w_old)
            moved_all = moved_all + moved
            elements = elements + w_old.numel()
        out["quant/bit_stall_rate"] = stalled_total / moved_q.clamp_min(1)
        out["quant/zero_update_frac"] = 1 - moved_all / elements.clamp_min(1)
        return out, histograms

    def _device(self) -> torch.device:
        return next(iter(self.linears.values())).weight.device
