"""The manifold optimizer: AdamW whose step on a quantized weight is measured in that weight's ULPs.

Δw = −lr_ulp · (lr / base_lr) · S(w) · m̂ / (√v̂ + eps), with S(w) the ULP of w in its layer's
current weight format and scale (`stiffness`). Plain AdamW steps of ~lr stall on a coarse grid
(the update rounds back to the same code); here every weight moves a consistent number of codes
whatever its binade. The trainer sets `group["lr"]` from the warmup + cosine schedule each step;
dividing by the peak lr (`base_lr`) carries that schedule over to the ULP step, so `lr_ulp` is the
ULP count per unit Adam direction at peak lr. Parameters that are not quantized weights
(embeddings, LayerNorm, biases, every parameter of the bf16 baseline) get plain AdamW steps.

Like fused AdamW under AMP, it honours `found_inf` (a 0-dim tensor): when > 0 nothing changes
(parameters, moments, step counts), decided on the device with gates instead of a host branch.
Formats and scales are read at each step, so an emergency mantissa shift takes effect at once.
The ULP is computed as `altgrad.quant.stall.stiffness` does, fused into the update kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from altgrad.optim.adamw import param_groups
from altgrad.quant.linear import QuantizedLinear
from altgrad.quant.quantize import _Kernel, _magic, _params


class ManifoldAdamW(torch.optim.Optimizer):
    _step_supports_amp_scaling = True

    def __init__(self, params, layers: dict[nn.Parameter, QuantizedLinear], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, lr_ulp: float = 1.0):
        if lr <= 0 or lr_ulp <= 0:
            raise ValueError(f"lr and lr_ulp must be > 0, got lr={lr}, lr_ulp={lr_ulp}")
        defaults = {"lr": lr, "base_lr": lr, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay, "lr_ulp": lr_ulp}
        super().__init__(params, defaults)
        self.layers = layers
        self.found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, beta1, beta2)
        return loss

    def _update(self, p: torch.Tensor, group: dict, beta1: float, beta2: float) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        found = self.found_inf
        go = torch.ones((), device=p.device) if found is None else (found.to(p.device) <= 0).float()
        step = state["step"].add_(go)
        n = step.clamp_min(1)  # a skipped first step must not divide by a zero bias correction
        lr = group["lr"]
        layer = self.layers.get(p)
        rate = lr if layer is None else group["lr_ulp"] * lr / group["base_lr"]
        h = torch.stack([go, go * (1 - beta1), go * (1 - beta2), 1 - beta1**n, 1 - beta2**n,
                         torch.full_like(go, group["eps"]), 1 - go * (lr * group["weight_decay"]),
                         go * rate])
        if layer is None:
            _ADAMW(p, p.grad, state["exp_avg"], state["exp_avg_sq"], h)
        else:
            fmt = layer.policy.weight
            scale = layer.scalers["weight"].scale.to(p)
            _ADAMW_ULP(p, p.grad, state["exp_avg"], state["exp_avg_sq"], h, scale,
                       _params(fmt, True, torch.float32, p.device), not fmt.subnormals)


def _adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: torch.Tensor,
           ulp: torch.Tensor | float = 1.0) -> None:
    """In place: p <- p * decay - rate * ulp * m_hat / (sqrt(v_hat) + eps), moments gated by h[0].

    h = [go, gated 1-beta1, gated 1-beta2, bias corrections 1 and 2, eps, decay, gated rate].
    A skipped step may carry NaN grads: they are zeroed, so the weight-0 updates stay exact.
    """
    g = torch.where(h[0] > 0, g, 0)
    m.lerp_(g, h[1])
    v.lerp_(g * g, h[2])
    direction = (m / h[3]) / ((v / h[4]).sqrt() + h[5])
    p.mul_(h[6]).sub_(direction * ulp * h[7])


def _adamw_ulp(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: torch.Tensor,
               scale: torch.Tensor, fmt_params: torch.Tensor, ftz: bool) -> None:
    """`_adamw` with the step measured in the ULP S(w) of the weight before the step."""
    ulp = _magic((p * scale).abs(), fmt_params, ftz) * 2.0**-23 / scale
    _adamw(p, g, m, v, h, ulp)


_ADAMW = _Kernel(_adamw)  # one fused pointwise kernel each (compiled when it compiles)
_ADAMW_ULP = _Kernel(_adamw_ulp)


def quantized_weights(model: nn.Module) -> dict[nn.Parameter, QuantizedLinear]:
    """Each quantized layer's weight Parameter -> its layer (format and scale are read per step)."""
    return {m.weight: m for m in model.modules() if isinstance(m, QuantizedLinear)}


def build_manifold(model: nn.Module, cfg) -> ManifoldAdamW:
    return ManifoldAdamW(
        param_groups(model, cfg.weight_decay),
        quantized_weights(model),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        lr_ulp=cfg.lr_ulp,
    )
