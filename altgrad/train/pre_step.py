"""The state a step starts from, kept until the step is known to be finite (SPEC §5: save-on-anomaly
saves the pre-step state at the first NaN of a streak).

A skipped step leaves the weights and the optimizer's moments as they were, but not the rest of a
checkpoint: its forward and backward wrote the scalers' amax histories and scales (the non-finite
amax included) and the partition clipper's, it drew random numbers, and it set the learning rate
(and, at an evaluation, the val loss). So each step's start keeps a copy of those parts: the
modules' persistent buffers (a few small tensors per quantized layer, copied in one `_foreach_copy_`
into buffers made once), the RNG state and a few numbers. The stability monitor and the layers'
formats change only after the step (`Trainer._apply_policy`), where the anomaly is saved before
them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rng_state() -> dict[str, Any]:
    """The RNG states a checkpoint restores: torch's CPU generator and every CUDA device's."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers its state dict holds, by their state-dict keys (the tensors themselves,
    which their owners write in place)."""
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if not isinstance(v, nn.Parameter)}


class StepStart:
    """What a checkpoint of the step before holds and a step can change while it is skipped, as it
    was when the step began (`capture`); `restore` puts it into a checkpoint dict made after it.

    `modules`: checkpoint key -> module whose state dict is saved under it (the model, the
    partition clipper). Their buffers must be written in place, never replaced: the scalers', the
    histories' and the counters' are (a checkpoint's load copies into them, a format shift too)."""

    def __init__(self, modules: dict[str, nn.Module]):
        self._buffers = {key: persistent_buffers(m) for key, m in modules.items()}
        self._live = [t for buffers in self._buffers.values() for t in buffers.values()]
        self._kept = [t.detach().clone() for t in self._live]
        self._numbers: dict[str, Any] = {}

    def capture(self, optimizer: torch.optim.Optimizer, **numbers: Any) -> None:
        """At a step's start: the buffers, the RNG states, each param group's learning rate and the
        `numbers` (checkpoint keys -> values, e.g. the val losses) it may change."""
        if self._live:
            torch._foreach_copy_(self._kept, self._live)
        self._numbers = {"rng": rng_state(), "lrs": [g["lr"] for g in optimizer.param_groups], **numbers}

    def restore(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state`, a checkpoint dict made during or after the step, with what the step changed as
        it was at its start."""
        kept = iter(self._kept)
        out = dict(state)
        for key, buffers in self._buffers.items():
            out[key] = {**state[key], **{name: next(kept) for name in buffers}}
        lrs = self._numbers["lrs"]
        groups = [{**g, "lr": lr} for g, lr in zip(state["optimizer"]["param_groups"], lrs, strict=True)]
        out["optimizer"] = {**state["optimizer"], "param_groups": groups}
        out.update({k: v for k, v in self._numbers.items() if k != "lrs"})
        return out
