"""Model surgery: swap the `nn.Linear` layers a layer-precision policy names for `QuantizedLinear`.

The policy's rules are `altgrad.precision`'s `(pattern, format)` pairs, resolved here to format
specs (`None`: the layer stays in high precision). Embeddings, LayerNorm and softmax are never
touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase

from torch import nn

from altgrad.precision import BASELINE, GRAD_FORMAT, policy_rules
from altgrad.quant.formats import FormatSpec, get_format
from altgrad.quant.linear import LinearQuantPolicy, QuantizedLinear


@dataclass(frozen=True)
class LayerPolicy:
    """Which layers get which format (`rules`), and what every quantized layer shares: `template`,
    a layer's `LinearQuantPolicy` but for its input and weight formats, which each layer's rule
    sets (grad_output keeps the template's format: gradients have their own)."""

    rules: tuple[tuple[str, FormatSpec | None], ...]  # (pattern, format); None: high precision
    template: LinearQuantPolicy = field(default_factory=lambda: LinearQuantPolicy(*[get_format(GRAD_FORMAT)] * 3))

    @classmethod
    def build(cls, precision: str | Sequence[tuple[str, str]], fmt: str,
              template: LinearQuantPolicy | None = None) -> LayerPolicy:
        """From a preset name (`altgrad.precision.PRECISION_PRESETS`) or `(pattern, format)` pairs."""
        rules = tuple((pattern, None if f.lower() == BASELINE else get_format(f))
                      for pattern, f in policy_rules(precision, fmt))
        return cls(rules) if template is None else cls(rules, template)

    def layer_policy(self, fmt: FormatSpec) -> LinearQuantPolicy:
        return replace(self.template, input=fmt, weight=fmt)

    def assign(self, names: Sequence[str]) -> dict[str, FormatSpec]:
        """Layer name -> format for every layer that gets quantized; unmatched rules are errors."""
        assigned: dict[str, FormatSpec] = {}
        used = [False] * len(self.rules)
        for name in names:
            for i, (pattern, fmt) in enumerate(self.rules):
                if fnmatchcase(name, pattern):
                    used[i] = True
                    if fmt is not None:
                        assigned[name] = fmt
                    break
        unmatched = [pattern for (pattern, _), u in zip(self.rules, used, strict=True) if not u]
        if unmatched:
            raise ValueError(
                f"layer pattern(s) {unmatched} match no linear layer (or only layers an earlier "
                f"rule already took); layers are: {list(names)}"
            )
        return assigned


def linear_layers(model: nn.Module) -> list[str]:
    """Fully qualified names of the model's `nn.Linear` layers, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def convert_to_quantized(model: nn.Module, policy: LayerPolicy) -> dict[str, FormatSpec]:
    """Swap, in place, each layer the policy names for a `QuantizedLinear`; returns the assignment."""
    assigned = policy.assign(linear_layers(model))
    for name, fmt in assigned.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, QuantizedLinear.from_float(getattr(parent, child), policy.layer_policy(fmt)))
    return assigned


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
