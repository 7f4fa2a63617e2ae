"""Per-layer numerical diagnostics, computed on the device.

Nothing here calls `.item()`: the trainer reads every tensor of a step in one host sync. A
per-layer metric of every layer is one 1-d tensor under the tuple of its names (`Metrics`), not a
0-dim tensor per layer: a step's few hundred metrics are a few dozen tensors to make and read.
Layer names drop the `transformer.` prefix (`h.0.mlp.c_fc`, `lm_head`).
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from altgrad.metrics import (
    ACT_KURTOSIS,
    BACKWARD_OVERFLOW_RATE,
    BACKWARD_UNDERFLOW_RATE,
    BIT_STALL_RATE,
    CODES_USED,
    FORWARD_OVERFLOW_RATE,
    FORWARD_UNDERFLOW_RATE,
    KURTOSIS_MAX,
    OVERFLOW_RATE,
    RATES_BY_PASS,
    UNDERFLOW_RATE,
    ZERO_UPDATE_FRAC,
    gradient_stat,
    per_layer,
)
from altgrad.quant.codes import code_moves_all
from altgrad.quant.convert import linear_layers
from altgrad.quant.formats import FormatSpec
from altgrad.quant.kernels import MAX, Kernel, family, grid_params, nearest_scaled
from altgrad.quant.linear import ROLES, QuantizedLinear, by_weight_format
from altgrad.quant.scaling import abs_max, scale_for
from altgrad.train.replay import ReplayedCall

Metrics = dict[str | tuple[str, ...], torch.Tensor]
"""A step's metrics on the device: a name maps to a 0-dim tensor, a tuple of names to a 1-d tensor
of their values in that order."""


@cache
def layer_metric_names(metric: str, layers: tuple[str, ...]) -> tuple[str, ...]:
    """The names of `metric` per layer (`metrics.per_layer`), the key of their block in `Metrics`."""
    return tuple(per_layer(metric, n) for n in layers)


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
    One compiled call (eagerly ~8 ops); in a step graph, lowered into it (`kernels.Kernel`)."""
    return _KURTOSIS(x.detach())


def _gradient_stats(g: torch.Tensor, p: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    g = g.float()
    l2, linf = torch.linalg.vector_norm(g), abs_max(g)
    dead = 1 - torch.count_nonzero(g) / g.numel()
    s = scale_for(linf, p[MAX], True, torch.ones_like(linf))  # compute_scale(linf, fmt)
    noise = torch.linalg.vector_norm(g - nearest_scaled(g, s, p, m0, ftz, pow2=True))  # s: a power of two
    snr = 20 * torch.log10(l2.clamp_min(1e-30) / noise.clamp_min(1e-30))
    return torch.stack([l2, linf, dead, snr])


def _gradient_stats_all(gs: list[torch.Tensor], p: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    return torch.stack([_gradient_stats(g.reshape(-1), p, m0, ftz) for g in gs])


_GRADIENT_STATS = Kernel(_gradient_stats_all, static_shapes=True)  # a run's gradients: the same shapes every step
GRADIENT_STATS = ("l2", "linf", "dead_frac", "snr")


def gradient_stats(grads: list[torch.Tensor], fmt: FormatSpec) -> torch.Tensor:
    """float32 [len(grads), 4]: [l2, linf, dead_frac, snr] of each gradient (GRADIENT_STATS), where
    snr is the SQNR (dB) of g under `fmt` with per-tensor amax scaling: how much the format would
    lose.

    One compiled call for all of them, two passes over each: a compiled call's host time, not the
    passes, is what a gradient costs (docs/design.md).
    """
    grads = [g.detach() for g in grads]
    return _GRADIENT_STATS(grads, grid_params(fmt, True, torch.float32, grads[0].device), *family(fmt))


@cache
def finite_code_counts(formats: tuple[FormatSpec, ...], device: torch.device) -> torch.Tensor:
    """Each format's `num_finite_codes`, on the device (made once per set of formats)."""
    return torch.tensor([f.num_finite_codes for f in formats], dtype=torch.float32, device=device)


class Diagnostics:
    """Gradient, activation, quantizer and bit-stall metrics of one training step.

    A diagnostic step is `begin`, forward and backward (the quantizers count into their
    `TensorStats`; a forward pre-hook on every linear takes its input's kurtosis), `after_backward`
    (activation and gradient metrics, and the snapshot of the weights), the optimizer step,
    `after_update` (update and quantizer metrics), `end`. The hooks stay registered and do nothing
    outside `begin` ... `end`: (un)registering 2 x layers hooks per step cost more than the step's
    counting.

    With `replay` (on CUDA), `after_backward` and `after_update` are each recorded as a CUDA graph
    and replayed (`ReplayedCall`, keyed by what they read that can move: `backward_reads`,
    `update_reads`): a diagnostic step then launches two graphs where it launched every kernel of
    the calls between. Their outputs are then the graphs' own tensors, which the next diagnostic
    step overwrites.

    With `stored_in_format` (`quant.master_weights: format`) the quantized weights are re-quantized
    after the update, stochastically where `quant.weight_rounding` says so, and what is stored is
    what the next step starts from: their bit-stall and code moves are read off the stored weights
    (a stochastic rounding moves part of the updates that round to nearest would lose). Then
    `keep_update`, between the update and the re-quantizing, keeps the raw update, which tells an
    updated weight from one the optimizer left alone."""

    def __init__(self, model: nn.Module, grad_format: FormatSpec, replay: bool = False,
                 stored_in_format: bool = False):
        self.linears: dict[str, nn.Linear] = {
            short_name(n): model.get_submodule(n) for n in linear_layers(model)
        }
        self.quantized = {n: m for n, m in self.linears.items() if isinstance(m, QuantizedLinear)}
        self._weights = [m.weight for m in self.linears.values()]
        # Which of each layer's roles are quantized (a role switched off uses no codes at all).
        self._roles_on = torch.tensor([[m.policy.quantizes(r) for r in ROLES] for m in self.quantized.values()],
                                      dtype=torch.float32, device=self._device())
        self._counters = [m.stats[r].counted for m in self.quantized.values() for r in ROLES]
        self._before: list[torch.Tensor] = []  # `snapshot`'s copies, allocated on first use
        self.stored_in_format = stored_in_format
        self._updated: list[torch.Tensor] = []  # `keep_update`'s copies (quantized layers), likewise
        self._kept_this_step = False  # `keep_update` called since the last `snapshot`
        self.grad_format = grad_format
        self.collecting = False
        self._kurtosis: dict[str, torch.Tensor] = {}
        for name, layer in self.linears.items():
            layer.register_forward_pre_hook(self._kurtosis_hook(name))
        if replay:
            self.after_backward = ReplayedCall(self.after_backward, self.backward_reads)
            self.after_update = ReplayedCall(self.after_update, self.update_reads)

    # What can move or change between steps (`ReplayedCall`), besides the weights and the
    # scalers' and counters' buffers, which are written in place and never replaced (by the
    # optimizer, a checkpoint's load, a format shift).
    def backward_reads(self) -> list[object]:
        """What `after_backward` reads: the kurtosis values by layer (outputs of the step graph),
        the gradients, and the snapshot's buffers (allocated at the first)."""
        return [*self._kurtosis, *self._kurtosis.values(), *(w.grad for w in self._weights), *self._before]

    def update_reads(self) -> list[object]:
        """What `after_update` reads: the snapshot, the kept update, and each quantized layer's
        policy (its formats decide which kernels run)."""
        return [*self._before, *self._updated, *(m.policy for m in self.quantized.values())]

    def after_backward(self) -> Metrics:
        """What is measured between the backward and the update: the activation and gradient
        metrics; and the snapshot of the weights that `after_update` compares the update with."""
        metrics = {**self.activation_metrics(), **self.gradient_metrics()}
        self.snapshot()
        return metrics

    def after_update(self) -> tuple[Metrics, dict[str, torch.Tensor]]:
        """The update metrics and the quantizer metrics, and each quantized layer's code-move
        histogram (`update_metrics`)."""
        update, moves = self.update_metrics()
        return {**update, **self.quant_metrics()}, moves

    # -- forward: activation kurtosis and quantizer counters --------------------------------
    def begin(self) -> None:
        self.collecting = True
        self._kurtosis = {}
        for layer in self.quantized.values():
            layer.collect_stats = True
        if self._counters:
            torch._foreach_zero_(self._counters)

    def _kurtosis_hook(self, name: str):
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if self.collecting:
                self._kurtosis[name] = kurtosis(args[0])  # now: x need not outlive the forward

        return hook

    def end(self) -> None:
        self.collecting = False
        for layer in self.quantized.values():
            layer.collect_stats = False
        self._kurtosis = {}

    def activation_metrics(self) -> Metrics:
        if not self._kurtosis:
            return {}
        values = torch.stack(list(self._kurtosis.values()))
        return {layer_metric_names(ACT_KURTOSIS, tuple(self._kurtosis)): values, KURTOSIS_MAX: values.max()}

    # -- backward: gradient statistics (before clipping) ---------------------------------
    def gradient_metrics(self) -> Metrics:
        grads = {n: layer.weight.grad for n, layer in self.linears.items() if layer.weight.grad is not None}
        if not grads:
            return {}
        stats = gradient_stats(list(grads.values()), self.grad_format)
        names = tuple(grads)
        return {layer_metric_names(gradient_stat(stat), names): stats[:, j] for j, stat in enumerate(GRADIENT_STATS)}

    # -- quantizer counters ------------------------------------------------------------
    def quant_metrics(self) -> Metrics:
        """Overflow / underflow rates and code-range utilisation, per layer and model-wide, from
        all layers' counters at once."""
        if not self.quantized:
            zero = torch.zeros((), device=self._device())
            return {name: zero for name in (OVERFLOW_RATE, UNDERFLOW_RATE, CODES_USED, *RATES_BY_PASS)}
        names, layers = tuple(self.quantized), list(self.quantized.values())
        counted = torch.stack(self._counters).view(len(layers), len(ROLES), -1)
        counts = counted[:, :, :3].sum(1).float()  # overflow, underflow, elements
        codes = (counted[:, :, 3:] > 0).sum(2)
        formats = tuple(layer.policy.format_of(r) for layer in layers for r in ROLES)
        on = self._roles_on  # mean over the roles each layer quantizes
        used = (codes / finite_code_counts(formats, codes.device).view(codes.shape) * on).sum(1) / on.sum(1)
        rates = counts[:, :2] / counts[:, 2:].clamp_min(1)
        # model-wide, in integers until the one division: both passes, the forward's roles (input,
        # weight), the backward's (grad_output)
        by_role = counted[:, :, :3].sum(0)  # role -> overflow, underflow, elements
        backward = by_role[ROLES.index("grad_output")]
        totals = by_role.sum(0)
        passes = torch.stack([totals, totals - backward, backward]).float()
        wide = passes[:, :2] / passes[:, 2:].clamp_min(1)
        return {layer_metric_names(OVERFLOW_RATE, names): rates[:, 0],
                layer_metric_names(UNDERFLOW_RATE, names): rates[:, 1],
                layer_metric_names(CODES_USED, names): used,
                OVERFLOW_RATE: wide[0, 0], UNDERFLOW_RATE: wide[0, 1],
                FORWARD_OVERFLOW_RATE: wide[1, 0], FORWARD_UNDERFLOW_RATE: wide[1, 1],
                BACKWARD_OVERFLOW_RATE: wide[2, 0], BACKWARD_UNDERFLOW_RATE: wide[2, 1],
                CODES_USED: used.mean()}

    # -- optimizer: bit-stall on the weights each quantized layer stores ---------------------
    @torch.no_grad()
    def snapshot(self) -> None:
        """Copy the weights before the optimizer step (all linears; the baseline measures zero
        updates) into buffers kept for the purpose, which `update_metrics` reads."""
        weights = [w.detach() for w in self._weights]
        if not self._before:
            self._before = [torch.empty_like(w) for w in weights]
        torch._foreach_copy_(self._before, weights)
        self._kept_this_step = False

    @torch.no_grad()
    def keep_update(self) -> None:
        """Weights stored in their format: copy each quantized weight as the optimizer left it,
        before the re-quantizing rounds it, into buffers kept for the purpose (`update_metrics`)."""
        self._kept_this_step = True
        weights = [m.weight.detach() for m in self.quantized.values()]
        if not weights:  # (a precision that keeps every layer high)
            return
        if not self._updated:
            self._updated = [torch.empty_like(w) for w in weights]
        torch._foreach_copy_(self._updated, weights)

    def update_metrics(self) -> tuple[Metrics, dict[str, torch.Tensor]]:
        """Bit-stall over the quantized layers' moved weights since `snapshot`; zero-update
        fraction over all.

        Also returns each quantized layer's code-move histogram (`code_moves`), for bit tracking.
        The code moves are one compiled call per weight format. Weights stored in their format
        move by their stored codes (`code_moves`' `kept`: the weights now, the update kept apart).
        """
        if not self._before:
            raise RuntimeError("Diagnostics.update_metrics compares the weights with a snapshot: call snapshot first")
        if self.stored_in_format and self.quantized and not self._kept_this_step:
            # (an update kept at an earlier step would compare this step's codes with a stale one)
            raise RuntimeError("Diagnostics.update_metrics of weights stored in their format needs this step's "
                               "raw update: call keep_update before re-quantizing the weights")
        before = dict(zip(self.linears, self._before, strict=True))
        updated = dict(zip(self.quantized, self._updated, strict=True)) if self.stored_in_format else None
        by_format = by_weight_format(self.quantized)
        out: Metrics = {}
        histograms: dict[str, torch.Tensor] = {}
        stalled, changed = [], []
        for fmt, names in by_format.items():
            weights = [self.quantized[n].weight for n in names]
            scales = [self.quantized[n].weight_scale for n in names]
            olds = [before[n] for n in names]
            if updated is not None:
                moves = code_moves_all(olds, [updated[n] for n in names], fmt, scales, kept=weights)
            else:
                moves = code_moves_all(olds, weights, fmt, scales)
            out[layer_metric_names(BIT_STALL_RATE, tuple(names))] = moves["stalled"] / moves["changed"].clamp_min(1)
            histograms.update(zip(names, moves["histogram"].unbind(), strict=True))
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


def per_name(metrics: Metrics) -> dict[str, torch.Tensor]:
    """`metrics` with every block split into its named 0-dim tensors (views), for a reader that
    wants one tensor per name; the trainer reads blocks whole."""
    out: dict[str, torch.Tensor] = {}
    for key, value in metrics.items():
        if isinstance(key, tuple):
            out.update(zip(key, value.unbind(), strict=True))
        else:
            out[key] = value
    return out
