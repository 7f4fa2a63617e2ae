"""Per-layer numerical diagnostics, computed on the device as 0-dim tensors.

Nothing here calls `.item()`: the trainer stacks every tensor of a step and reads them in one
host sync. Layer names drop the `transformer.` prefix (`h.0.mlp.c_fc`, `lm_head`).
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from altgrad.metrics import (
    ACT_KURTOSIS,
    BIT_STALL_RATE,
    CODES_USED,
    KURTOSIS_MAX,
    OVERFLOW_RATE,
    UNDERFLOW_RATE,
    ZERO_UPDATE_FRAC,
    gradient_stat,
    per_layer,
)
from altgrad.quant.codes import code_moves_all
from altgrad.quant.convert import linear_layers
from altgrad.quant.formats import FormatSpec
from altgrad.quant.kernels import MAX, Kernel, grid_params, nearest_scaled
from altgrad.quant.linear import ROLES, QuantizedLinear, by_weight_format
from altgrad.quant.scaling import abs_max, scale_for
from altgrad.quant.step import observed_counts

Metrics = dict[str, torch.Tensor]


def short_name(name: str) -> str:
    return name.removeprefix("transformer.")


def _kurtosis(x: torch.Tensor) -> torch.Tensor:
    x = x.float().flatten()
    d = x - x.mean()
    var = d.square().mean()
    return d.square().square().mean() / var.square().clamp_min(1e-30)


_KURTOSIS = Kernel(_kurtosis)


def kurtosis(x: torch.Tensor) -> torch.Tensor:
    """Excess-free (Pearson) kurtosis E[(x-mu)^4] / var^2 of all elements; 3 for a Gaussian.
    One compiled call (eagerly ~8 ops)."""
    return _KURTOSIS(x.detach())


def _gradient_stats(g: torch.Tensor, p: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    g = g.float()
    l2, linf = torch.linalg.vector_norm(g), abs_max(g)
    dead = 1 - torch.count_nonzero(g) / g.numel()
    s = scale_for(linf, p[MAX], True, torch.ones_like(linf))  # compute_scale(linf, fmt)
    noise = torch.linalg.vector_norm(g - nearest_scaled(g, s, p, m0, ftz))
    snr = 20 * torch.log10(l2.clamp_min(1e-30) / noise.clamp_min(1e-30))
    return torch.stack([l2, linf, dead, snr])


def _gradient_stats_all(gs: list[torch.Tensor], p: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    return torch.stack([_gradient_stats(g.reshape(-1), p, m0, ftz) for g in gs])


_GRADIENT_STATS = Kernel(_gradient_stats_all)
GRADIENT_STATS = ("l2", "linf", "dead_frac", "snr")


def gradient_stats(grads: list[torch.Tensor], fmt: FormatSpec) -> torch.Tensor:
    """float32 [len(grads), 4]: [l2, linf, dead_frac, snr] of each gradient (GRADIENT_STATS), where
    snr is the SQNR (dB) of g under `fmt` with per-tensor amax scaling: how much the format would
    lose.

    One compiled call for all of them, two passes over each (five passes and ~20 eager ops per
    gradient before; one call per gradient cost ~0.1 ms of host time each).
    """
    grads = [g.detach() for g in grads]
    return _GRADIENT_STATS(grads, grid_params(fmt, True, torch.float32, grads[0].device), fmt.mbits == 0,
                           not fmt.subnormals)


@cache
def finite_code_counts(formats: tuple[FormatSpec, ...], device: torch.device) -> torch.Tensor:
    """Each format's `num_finite_codes`, on the device (made once per set of formats)."""
    return torch.tensor([f.num_finite_codes for f in formats], dtype=torch.float32, device=device)


class Diagnostics:
    """Gradient, activation, quantizer and bit-stall metrics of one training step."""

    def __init__(self, model: nn.Module, grad_format: FormatSpec):
        self.linears: dict[str, nn.Linear] = {
            short_name(n): model.get_submodule(n) for n in linear_layers(model)
        }
        self.quantized = {n: m for n, m in self.linears.items() if isinstance(m, QuantizedLinear)}
        # Which of each layer's roles are quantized (a role switched off uses no codes at all).
        self._roles_on = torch.tensor([[m.policy.quantizes(r) for r in ROLES] for m in self.quantized.values()],
                                      dtype=torch.float32)
        self.grad_format = grad_format
        self._kurtosis: Metrics = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    # -- forward: activation kurtosis and quantizer counters --------------------------------
    def begin(self) -> None:
        self.end()  # a step that raised before `end` left its hooks behind
        for layer in self.quantized.values():
            layer.collect_stats = True
            for stats in layer.stats.values():
                stats.reset()
        for name, layer in self.linears.items():
            self._hooks.append(layer.register_forward_pre_hook(self._kurtosis_hook(name)))

    def _kurtosis_hook(self, name: str):
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self._kurtosis[name] = kurtosis(args[0])  # now: x need not outlive the forward

        return hook

    def end(self) -> None:
        for layer in self.quantized.values():
            layer.collect_stats = False
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._kurtosis = {}

    def activation_metrics(self) -> Metrics:
        out = {per_layer(ACT_KURTOSIS, n): k for n, k in self._kurtosis.items()}
        if self._kurtosis:
            out[KURTOSIS_MAX] = torch.stack(list(self._kurtosis.values())).max()
        return out

    # -- backward: gradient statistics (before clipping) ---------------------------------
    def gradient_metrics(self) -> Metrics:
        grads = {n: layer.weight.grad for n, layer in self.linears.items() if layer.weight.grad is not None}
        if not grads:
            return {}
        stats = gradient_stats(list(grads.values()), self.grad_format)
        return {per_layer(gradient_stat(stat), name): v
                for name, row in zip(grads, stats, strict=True) for stat, v in zip(GRADIENT_STATS, row, strict=True)}

    # -- quantizer counters ------------------------------------------------------------
    def quant_metrics(self) -> Metrics:
        """Overflow / underflow rates and code-range utilisation, per layer and model-wide, from
        all layers' counters at once (one compiled call per format and a few ops, not ~20 per layer)."""
        names, layers = list(self.quantized), list(self.quantized.values())
        if not layers:
            zero = torch.zeros((), device=self._device())
            return {OVERFLOW_RATE: zero, UNDERFLOW_RATE: zero, CODES_USED: zero}
        shape = (len(layers), len(ROLES))
        counts, histograms = observed_counts([layer.stats[r] for layer in layers for r in ROLES], self._device())
        counts = counts.view(*shape, 3).sum(1)  # overflow, underflow, elements
        codes = (histograms > 0).sum(1).view(shape)
        formats = tuple(layer.policy.format_of(r) for layer in layers for r in ROLES)
        on = self._roles_on.to(codes.device)  # mean over the roles each layer quantizes
        used = (codes / finite_code_counts(formats, codes.device).view(shape) * on).sum(1) / on.sum(1)
        rates = counts[:, :2] / counts[:, 2:].clamp_min(1)
        out: Metrics = {}
        for i, name in enumerate(names):
            out[per_layer(OVERFLOW_RATE, name)] = rates[i, 0]
            out[per_layer(UNDERFLOW_RATE, name)] = rates[i, 1]
            out[per_layer(CODES_USED, name)] = used[i]
        totals = counts.sum(0)
        out[OVERFLOW_RATE] = totals[0] / totals[2].clamp_min(1)
        out[UNDERFLOW_RATE] = totals[1] / totals[2].clamp_min(1)
        out[CODES_USED] = used.mean()
        return out

    # -- optimizer: bit-stall on the weights each quantized layer stores ---------------------
    def snapshot(self) -> dict[str, torch.Tensor]:
        """Weights before the optimizer step (all linears; the baseline measures zero updates)."""
        return {n: m.weight.detach().clone() for n, m in self.linears.items()}

    def update_metrics(self, before: dict[str, torch.Tensor]) -> tuple[Metrics, dict[str, torch.Tensor]]:
        """Bit-stall over the quantized layers' moved weights; zero-update fraction over all.

        Also returns each quantized layer's code-move histogram (`code_moves`), for bit tracking.
        The code moves are one compiled call per weight format.
        """
        by_format = by_weight_format({n: self.quantized[n] for n in before if n in self.quantized})
        out: Metrics = {}
        histograms: dict[str, torch.Tensor] = {}
        stalled, changed = [], []
        for fmt, names in by_format.items():
            layers = [self.quantized[n] for n in names]
            moves = code_moves_all([before[n] for n in names], [m.weight.detach() for m in layers], fmt,
                                   [m.weight_scale for m in layers])
            rates = moves["stalled"] / moves["changed"].clamp_min(1)
            out.update({per_layer(BIT_STALL_RATE, n): r for n, r in zip(names, rates, strict=True)})
            histograms.update(zip(names, moves["histogram"], strict=True))
            stalled.append(moves["stalled"])
            changed.append(moves["changed"])
        moved_all = [torch.count_nonzero(self.linears[n].weight.detach() - w)  # (finite weights: != w)
                     for n, w in before.items() if n not in self.quantized]
        dev = self._device()
        stalled_total, moved_q = (torch.cat(x).sum() if x else torch.zeros((), device=dev) for x in (stalled, changed))
        moved = moved_q + (torch.stack(moved_all).sum() if moved_all else 0)
        elements = sum(w.numel() for w in before.values())
        out[BIT_STALL_RATE] = stalled_total / moved_q.clamp_min(1)
        out[ZERO_UPDATE_FRAC] = 1 - moved / max(elements, 1)
        return out, histograms

    def _device(self) -> torch.device:
        return next(iter(self.linears.values())).weight.device
