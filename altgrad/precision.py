"""Layer-precision policies as data: which linear layers a run quantizes, by name pattern.

A policy is an ordered list of `(pattern, format)` rules matched against fully qualified module
names with shell-style globs (`*.mlp.*`, `lm_head`); the first matching rule wins. A rule's format
is a format name, `BASELINE` (the layer stays in high precision) or `FORMAT_PLACEHOLDER` (the run's
own format). The presets below are the grid's layer types. This module is plain data, imported by
the run config (which validates names) and by `altgrad.quant.convert` (which swaps the layers), so
neither needs the other, and reading a config needs no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

BASELINE = "bf16"  # the unquantized run, and in a rule: this layer stays in high precision
FORMAT_PLACEHOLDER = "{fmt}"  # in a rule: the run's format
GRAD_FORMAT = "e5m2"  # grad_output's format unless a run names one: gradients span a wide range

PRECISION_PRESETS: dict[str, tuple[tuple[str, str], ...]] = {
    "all": (("*", FORMAT_PLACEHOLDER),),
    "mlp": (("*.mlp.*", FORMAT_PLACEHOLDER),),  # attention stays high precision
    "attn": (("*.attn.*", FORMAT_PLACEHOLDER),),
    "no_head": (("lm_head", BASELINE), ("*", FORMAT_PLACEHOLDER)),
}


def policy_rules(precision: str | Sequence[tuple[str, str]], fmt: str) -> list[tuple[str, str]]:
    """A preset's name or custom rules -> `(pattern, format)` with the placeholder filled in."""
    if isinstance(precision, str):
        if precision not in PRECISION_PRESETS:
            raise ValueError(f"unknown layer precision {precision!r}; choose one of {list(PRECISION_PRESETS)} "
                             "or give a list of {pattern, format} rules")
        precision = PRECISION_PRESETS[precision]
    return [(pattern, fmt if f == FORMAT_PLACEHOLDER else f) for pattern, f in precision]
