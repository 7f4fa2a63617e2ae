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

    def _add(self, kind: str, layer: str, blame: tuple[str, ...]) -> None:
        self.probes.append((kind, layer))
        self.blames.append(blame)

    @torch.no_grad()
    def first_bad(self, loss: torch.Tensor, grad_norms: dict[nn.Parameter, torch.Tensor]) -> torch.Tensor:
        """0-dim float: the index of the first non-finite probe, -1 when all are finite."""
        values = []
        for kind, name in self.probes:
            if kind == "loss":
                values.append(loss.detach().float().reshape(()))
            elif kind == "weight_grad":
                norm = grad_norms.get(self.layers[name].weight)
                values.append(torch.zeros_like(loss, dtype=torch.float32) if norm is None else norm.float())
            else:
                values.append(self.layers[name].scalers[kind].amax)
        return first_nonfinite(torch.stack(values))

    def blame(self, index: int) -> list[str]:
        """The layers blamed for the probe `index` (empty: not localized or nothing bad)."""
        return list(self.blames[index]) if index >= 0 else []


def first_nonfinite(values: torch.Tensor) -> torch.Tensor:
    """0-dim float index of the first non-finite element of a 1-D tensor, -1 if there is none."""
    bad = ~torch.isfinite(values)
    first = torch.argmax(bad.float())  # argmax returns the first maximal index
    return torch.where(bad.any(), first, -1).float()
