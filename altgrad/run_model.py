"""A run's model: the GPT with the run's layer-precision policy applied (`build_model`), and the
check of that policy against the model's layers (`check_layer_policy`), which the training CLI
and a sweep's validation make before anything runs (this module loads no trainer).
"""

from __future__ import annotations

import torch

from altgrad.config import ConfigError, RunConfig
from altgrad.model import GPT, GPTConfig
from altgrad.quant.convert import LayerPolicy, convert_to_quantized, linear_layers
from altgrad.quant.formats import FormatSpec, get_format
from altgrad.quant.linear import LinearQuantPolicy


def build_model(cfg: RunConfig) -> GPT:
    """The GPT with the run's layer-precision policy applied (the baseline stays plain)."""
    model = GPT(GPTConfig(**cfg.model.model_dump()))
    if not cfg.quant.is_baseline:
        convert_to_quantized(model, layer_policy(cfg))
    return model


def layer_policy(cfg: RunConfig) -> LayerPolicy:
    """The run's layer-precision policy: its preset or rules, each quantized layer's roles,
    formats, scaling and rounding."""
    q = cfg.quant
    precision = q.precision if isinstance(q.precision, str) else [(r.pattern, r.format) for r in q.precision]
    grad_format = get_format(q.grad_format)
    template = LinearQuantPolicy(
        input=grad_format, weight=grad_format, grad_output=grad_format,  # input, weight: per rule
        scaling=q.scaling.policy(),
        grad_scaling=q.grad_scaling.policy(),
        rounding=q.rounding,
        clip_ste=q.clip_ste,
        quantized=q.roles.enabled,
    )
    return LayerPolicy.build(precision, q.format, template)


def assigned_formats(cfg: RunConfig) -> dict[str, FormatSpec]:
    """Each linear layer the run quantizes, with its format: the run's precision rules matched
    against its model's layers, built without storage (the meta device); the baseline's none.
    ValueError where a rule matches no layer."""
    if cfg.quant.is_baseline:
        return {}
    with torch.device("meta"):
        model = GPT(GPTConfig(**cfg.model.model_dump()))
    return layer_policy(cfg).assign(linear_layers(model))


def check_layer_policy(cfg: RunConfig) -> None:
    """ConfigError where a rule of `quant.precision` matches no linear layer of the run's model
    (SPEC §3): before any data is prepared, any directory written or any trial started. Layer
    names come from the model, so the check cannot drift from what `build_model` swaps."""
    try:
        assigned_formats(cfg)
    except ValueError as e:
        raise ConfigError(f"quant.precision: {e}") from None
