"""Which quantized layer a non-finite step started in, so the mantissa shift moves only that one.

The trainer cannot look at every activation, but it already holds, on the device, one probe per
point where a non-finite value would first become visible: each quantized layer's raw input and
grad_output amax (recorded by its scalers), the loss, and each weight's gradient norm (the
per-parameter norms behind the clipping norm). `NanOrigin.first_bad` reduces them on the device to
the index of the first non-finite probe in execution order, a 0-dim tensor that joins the step's
one host sync; `blame` turns that index into layer names on the host.

The rule walks the step as it ran (layers in module order, which is GPT's execution order):
- forward, each layer's input: a non-finite input of layer i was produced between layer i-1's
  quantized matmul and layer i (i-1's output and the unquantized ops after it), so i-1 is blamed;
  the first layer's input comes from the embeddings, which no shift can fix: not localized;
- the loss, with every input finite: the last layer (its output feeds the loss);
- backward, in reverse order, each layer's grad_output, then its weight gradient: a non-finite
  grad_output of layer j with every later one finite was produced by the layer processed just
  before it in backward, j+1 (its input gradient); for the last layer, by the loss gradient of its
  own output, so the last layer; a non-finite weight gradient with finite input and grad_output
  means that layer's own gradient matmul (or a grad_output that overflowed when quantized);
- a weight shared with another module (GPT's lm_head / wte tying) also collects gradient after
  the whole backward, from the first layer's input gradient through the embedding: its probe comes
  last and blames both the layer and the first layer.
"""

from __future__ import annotations

import torch
from torch import nn

from altgrad.quant.linear import QuantizedLinear
from altgrad.quant.scaling import AMAX


class NanOrigin:
    def __init__(self, layers: dict[str, QuantizedLinear], model: nn.Module):
        self.layers = layers
        names = list(layers)
        uses: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        self.shared = {n for n, layer in layers.items() if uses.get(id(layer.weight), 0) > 1}
        self.probes: list[tuple[str, str]] = []  # (kind, layer) in execution order; kind "loss" has layer ""
        self.blames: list[tuple[str, ...]] = []
        for i, name in enumerate(names):
            self._add("input", name, (names[i - 1],) if i else ())
        self._add("loss", "", names[-1:])
        for j in reversed(range(len(names))):
            name = names[j]
            self._add("grad_output", name, (names[j + 1],) if j + 1 < len(names) else (name,))
            if name not in self.shared:
                self._add("weight_grad", name, (name,))
        for name in names:
            if name in self.shared:
                self._add("weight_grad", name, (name, names[0]) if name != names[0] else (name,))
        # Where each probe's value is found in one vector made per step, [loss, every scaler's
        # amax, every weight's gradient norm]: a few ops a step, not one per probe.
        self._scalers = [(layer, kind) for layer in names for kind in ("input", "grad_output")]
        self._states = [layers[n].scalers[kind].state for n, kind in self._scalers]  # updated in place
        self._weights = [layer.weight for layer in layers.values()]
        self._order: torch.Tensor | None = None

    def _add(self, kind: str, layer: str, blame: tuple[str, ...]) -> None:
        self.probes.append((kind, layer))
        self.blames.append(blame)

    def _probe_order(self, device: torch.device) -> torch.Tensor:
        if self._order is None:
            names = list(self.layers)
            at = {("loss", ""): 0}
            at.update({(kind, n): 1 + i for i, (n, kind) in enumerate(self._scalers)})
            at.update({("weight_grad", n): 1 + len(self._scalers) + i for i, n in enumerate(names)})
            self._order = torch.tensor([at[probe] for probe in self.probes], device=device)
        return self._order

    @torch.no_grad()
    def first_bad(self, loss: torch.Tensor, grad_norms: dict[nn.Parameter, torch.Tensor]) -> torch.Tensor:
        """0-dim float: the index of the first non-finite probe, -1 when all are finite."""
        if not self.layers:
            return first_nonfinite(loss.detach().float().reshape(1))
        amax = torch.stack(self._states)[:, AMAX]
        zero = torch.zeros((), device=loss.device)
        norms = torch.stack([grad_norms.get(w, zero) for w in self._weights]).float()
        values = torch.cat([loss.detach().float().reshape(1), amax, norms])
        return first_nonfinite(values[self._probe_order(values.device)])

    def blame(self, index: int) -> list[str]:
        """The layers blamed for the probe `index` (empty: not localized or nothing bad)."""
        return list(self.blames[index]) if index >= 0 else []


def first_nonfinite(values: torch.Tensor) -> torch.Tensor:
    """0-dim float index of the first non-finite element of a 1-D tensor, -1 if there is none."""
    bad = ~torch.isfinite(values)
    first = torch.argmax(bad.float())  # argmax returns the first maximal index
    return torch.where(bad.any(), first, -1).float()
