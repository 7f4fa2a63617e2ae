"""Emergency mantissa shift (SPEC §6): move a layer's input and weight one exponent bit to mantissa.

Shifting is a host-side decision (the stability monitor's), applied here to the modules. The
weight scale is recomputed for the new format from the amax history at once: the old scale was
sized for the old format's range, and format-mode re-quantization or the manifold optimizer's ULP
would otherwise use it for a step. Formats are part of the checkpoint (`layer_formats`) and are
restored before the state dict so a resumed run keeps the shifted formats.
"""

from __future__ import annotations

from altgrad.experiment import EventKind
from altgrad.quant.formats import get_format
from altgrad.quant.linear import QuantizedLinear
from altgrad.train.stability import Event

SHIFTED_ROLES = ("input", "weight")


def shift_layers(layers: dict[str, QuantizedLinear], names: list[str], reason: str) -> list[Event]:
    """Shift each named layer that has a next-mantissa format; one `format_shift` event per layer."""
    events = []
    for name in names:
        layer = layers[name]
        old = layer.policy.weight
        new = old.next_mantissa_format()
        if new is None:
            continue
        for role in SHIFTED_ROLES:
            layer.set_format(role, new)  # its scaler re-derives the scale for the new range
        events.append(Event(EventKind.FORMAT_SHIFT, f"{name}: {old.name} -> {new.name} ({reason})",
                            {"layer": name, "from": old.name, "to": new.name, "reason": reason}))
    return events


def layer_formats(layers: dict[str, QuantizedLinear]) -> dict[str, dict[str, str]]:
    return {n: {r: layer.policy.format_of(r).name for r in SHIFTED_ROLES} for n, layer in layers.items()}


def restore_formats(layers: dict[str, QuantizedLinear], formats: dict[str, dict[str, str]]) -> None:
    for name, roles in formats.items():
        for role, fmt in roles.items():
            layers[name].set_format(role, get_format(fmt))
