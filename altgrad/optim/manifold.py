"""The manifold optimizer: AdamW whose step on a quantized weight is measured in that weight's ULPs.

Δw = −lr_ulp · (lr / base_lr) · S(w) · m̂ / (√v̂ + eps), with S(w) the ULP of w in its layer's
current weight format and scale (`stiffness`). Plain AdamW steps of ~lr stall on a coarse grid
(the update rounds back to the same code); here every weight moves a consistent number of codes
whatever its binade. The trainer sets `group["lr"]` from the warmup + cosine schedule each step;
dividing by the peak lr (`base_lr`) carries that schedule over to the ULP step, so `lr_ulp` is the
ULP count per unit Adam direction at peak lr. With `follow_lr=False` the factor is 1 (SPEC §6's
Δw = −lr_ulp · S(w) · adam_direction; weight decay still follows the lr): with weights stored in
the format, a decayed step under half an ULP rounds back every time, so a run that follows the
schedule freezes late. Parameters that are not quantized weights (embeddings, LayerNorm, biases,
every parameter of the bf16 baseline) get plain AdamW steps, from torch's fused AdamW kernel.

Like fused AdamW under AMP, it honours `found_inf` (a 0-dim tensor, 1 when a gradient is not
finite, as GradScaler sets it): then nothing changes (parameters, moments, step counts), decided
on the device with a select instead of a host branch. Compiled and eager steps agree to float32
rounding (~1e-7 relative), not bit for bit: inductor orders the update's arithmetic its own way.
Formats and scales are read at each step, so an emergency mantissa shift takes effect at once.
The ULP is computed as `altgrad.quant.stall.stiffness` does, fused into the update kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from altgrad.optim.adamw import param_groups
from altgrad.quant.kernels import Kernel, grid_params, ulp
from altgrad.quant.linear import QuantizedLinear, by_weight_format


class ManifoldAdamW(torch.optim.Optimizer):
    _step_supports_amp_scaling = True  # torch's flag: step(found_inf=...) skips a non-finite step

    def __init__(self, params, layers: dict[nn.Parameter, QuantizedLinear], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, lr_ulp: float = 1.0, follow_lr: bool = True):
        if lr <= 0 or lr_ulp <= 0:
            raise ValueError(f"lr and lr_ulp must be > 0, got lr={lr}, lr_ulp={lr_ulp}")
        defaults = {"lr": lr, "base_lr": lr, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay, "lr_ulp": lr_ulp, "follow_lr": follow_lr,
                    "fused": True}  # as for fused AdamW: load_state_dict moves `step` to the param's device
        super().__init__(params, defaults)
        self.layers = layers
        self.found_inf: torch.Tensor | None = None

    def __setstate__(self, state: dict) -> None:
        """Loading a checkpoint restores its groups; the ULP step's settings stay the run's own, so
        `--resume --set optim.lr_ulp_schedule=...` (or lr_ulp) takes effect, and a checkpoint from
        before the option loads."""
        super().__setstate__(state)
        for group in self.param_groups:
            group["lr_ulp"], group["follow_lr"] = self.defaults["lr_ulp"], self.defaults["follow_lr"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        """Plain parameters in one fused AdamW call; quantized weights in fused ULP kernels.

        Per-parameter work on the host is what made this slower than fused AdamW, so the quantized
        weights' updates, step counts and bias corrections are one compiled call per
        weight format, and nothing else runs on the host.
        """
        device = params[0].device
        for p in params:
            if not self.state[p]:
                self.state[p].update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                                     exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                     exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
        found = None if self.found_inf is None else self.found_inf.to(device=device, dtype=torch.float32)
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        plain = [p for p in params if p not in self.layers]
        if plain:
            _fused_adamw(plain, [self.state[p] for p in plain], group, found)
        quantized = [p for p in params if p in self.layers]
        if not quantized:
            return
        if found is None:
            found = torch.zeros((), device=device)
        lr_ulp = group["lr_ulp"] * (lr / group["base_lr"] if group["follow_lr"] else 1.0)
        # One kernel call per format, every weight of it in place (`ADAMW_ULP_ALL`: static shapes).
        scheduled = scheduled_rates(lr_ulp, lr * group["weight_decay"], device)
        for fmt, ps in by_weight_format({p: self.layers[p] for p in quantized}).items():
            states = [self.state[p] for p in ps]
            ADAMW_ULP_ALL(grid_params(fmt, True, torch.float32, device), not fmt.subnormals, found,
                          Hyperparameters(beta1, beta2, group["eps"]), scheduled,
                          ps, [p.grad for p in ps], [s["exp_avg"] for s in states],
                          [s["exp_avg_sq"] for s in states],
                          [s["step"] for s in states], [self.layers[p].weight_scale for p in ps])


def _fused_adamw(params: list[torch.Tensor], states: list[dict], group: dict,
                 found: torch.Tensor | None) -> None:
    """torch's fused AdamW kernel, called as `torch.optim.AdamW(fused=True)` calls it (one call per
    device and dtype; bit for bit the same step), without the rest of its Python wrapper, which
    costs more host time than the kernel on the few small plain parameters. Grouping by device and
    dtype is skipped: here there is always one of each (docs/design.md, "Where a step's time goes")."""
    beta1, beta2 = group["betas"]
    tensors = [[p.detach() for p in params], [p.grad for p in params], [s["exp_avg"] for s in states],
               [s["exp_avg_sq"] for s in states], [s["step"] for s in states]]
    if len({(p.device, p.dtype, g.dtype) for p, g in zip(tensors[0], tensors[1], strict=True)}) == 1:
        groups = [tensors]
    else:
        groups = [lists for lists, _ in torch.optim.Optimizer._group_tensors_by_device_and_dtype(tensors).values()]
    for ps, grads, exp_avgs, exp_avg_sqs, steps in groups:
        device_found = None if found is None else found.to(ps[0].device)
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(ps, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False,
                            lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                            eps=group["eps"], maximize=False, grad_scale=None, found_inf=device_found)
        if device_found is not None:
            torch._foreach_sub_(steps, [device_found] * len(steps))


class Hyperparameters(NamedTuple):
    """A group's hyperparameters that no schedule changes: Python floats, the same at every step
    (a torch that specializes floats compiles them in as constants; 2.13 traces them as symbols)."""

    beta1: float
    beta2: float
    eps: float


# The entries of `scheduled_rates`: what the lr schedule changes every step.
LR_ULP = 0  # ULPs per unit Adam direction at this step's lr
DECAY_RATE = 1  # lr * weight_decay


def scheduled_rates(lr_ulp: float, decay_rate: float, device: torch.device) -> torch.Tensor:
    """The update's scalars that follow the lr schedule, as a float32 tensor on the device (entries
    LR_ULP, DECAY_RATE): a tensor's value is no part of a compiled graph. As Python floats they
    were, on a torch that specializes floats (2.11 does; 2.13 traces them as symbols): the update
    compiled anew every step, each compile reading constants back to the host, until dynamo's
    recompile limit sent it to eager. Made by `full`, whose value is a kernel argument: a tensor
    made on the host and copied would be a host sync on a GPU. Each is the float32 rounding of the
    double, as an eager `tensor * float` rounds the float."""
    return torch.stack([torch.full((), v, dtype=torch.float32, device=device) for v in (lr_ulp, decay_rate)])


# The rows of `adamw_ulp_all`'s per-weight coefficients.
SCALE = 0           # the weight's scale
RATE = 1            # lr_ulp / (1 - beta1^t) / scale: ULPs of the scaled weight -> the weight's step
V_CORRECTION = 2    # 1 / sqrt(1 - beta2^t)
M_KEEP, M_NEW, V_KEEP, V_NEW, DECAY = 3, 4, 5, 6, 7  # the moments' weights and the decay factor


def _adamw_ulp(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, coef: torch.Tensor,
               go: torch.Tensor, eps: float, fmt_params: torch.Tensor, ftz: bool) -> None:
    """In place: p <- p * decay - lr_ulp * S(p) * m_hat / (sqrt(v_hat) + eps), when `go` is 1.

    S is the ULP of the weight before the step, in its format at its scale. The coefficients (rows
    SCALE ... DECAY) fold the scalars of the update, so each element costs a single division (see
    `adamw_ulp_all`). When `go` is 0 nothing changes, exactly: the new values are computed and not
    kept (the grads of a skipped step may be NaN). Selected at the end, not by zeroing the grad
    first: compiled, a grad zeroed under a scalar condition became a masked load (the C++
    compiler's, of inductor's blend), on which the loop stalled (docs/design.md).
    """
    step = ulp((p * coef[SCALE]).abs(), fmt_params, ftz)
    m_new = m * coef[M_KEEP] + g * coef[M_NEW]
    v_new = v * coef[V_KEEP] + g * g * coef[V_NEW]
    p_new = p * coef[DECAY] - m_new / (v_new.sqrt() * coef[V_CORRECTION] + eps) * step * coef[RATE]
    keep = go > 0
    for old, new in ((m, m_new), (v, v_new), (p, p_new)):
        old.copy_(torch.where(keep, new, old))


def adamw_ulp_all(fmt_params: torch.Tensor, ftz: bool, found: torch.Tensor, hyper: Hyperparameters,
                  scheduled: torch.Tensor, ps: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor],
                  vs: list[torch.Tensor], steps: list[torch.Tensor], scales: list[torch.Tensor]) -> None:
    """`_adamw_ulp` on every weight of one format, as one compiled graph with its step
    counts and bias corrections: a compiled call or an eager op costs more host time than a
    small weight's update, so a step is one call per format.

    Every scalar the element loops need is computed here, once, into `coef` (one column per weight):
    inductor inlines scalar arithmetic into the loops that use it, which would recompute the bias
    corrections' `pow`s for every element (measured in docs/design.md).
    """
    go = (found <= 0).float()  # 1: step, 0: skip (a skipped step counts no step; `_adamw_ulp` keeps all)
    # A list of tensors, not the 0-dim `go` alone: AOTAutograd decomposes `_foreach_add_(list,
    # tensor)` through the tensor's `.item()`, a host sync on a GPU (SPEC §5 allows one per step).
    torch._foreach_add_(steps, [go] * len(steps))
    t = torch.stack(steps).clamp_min(1)  # a skipped first step must not divide by a zero bias correction
    scale = torch.stack(scales)
    rate = scheduled[LR_ULP] / (1 - hyper.beta1**t)  # with bias correction 1
    # the moments' weights of the new grad (`full_like`, a fill on the device: see `scheduled_rates`)
    w1, w2 = (torch.full_like(go, 1 - beta) for beta in (hyper.beta1, hyper.beta2))
    weights = torch.stack([1 - w1, w1, 1 - w2, w2, 1 - scheduled[DECAY_RATE]])
    coef = torch.cat([torch.stack([scale, rate / scale, (1 - hyper.beta2**t).rsqrt()]),  # SCALE, RATE, V_CORRECTION
                      weights[:, None].expand(-1, len(ps))])
    for i in range(len(ps)):
        _adamw_ulp(ps[i], gs[i], ms[i], vs[i], coef[:, i], go, hyper.eps, fmt_params, ftz)


# What `ManifoldAdamW.step` calls, once per weight format. Static shapes (`Kernel`): a run's
# shapes never change, and a format shift that regroups the layers compiles one more graph
# either way (dynamo specializes Parameters' shapes even in a dynamic graph).
ADAMW_ULP_ALL = Kernel(adamw_ulp_all, static_shapes=True)


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
        follow_lr=cfg.lr_ulp_schedule == "follow_lr",
    )
