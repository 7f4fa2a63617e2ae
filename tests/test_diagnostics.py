"""Diagnostics over many layers at once: batched kernels must still give each layer its own numbers
(eager and compiled: the batching, offsets included, happens inside the compiled graph)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from altgrad.quant import FORMATS, code_moves
from altgrad.quant.linear import ROLES, LinearQuantPolicy, QuantizedLinear, ScalingPolicy
from altgrad.train.diagnostics import Diagnostics, per_name


def quantized(fmt: str, scale: float, act: str | None = None, roles: tuple[str, ...] = ROLES) -> QuantizedLinear:
    spec = FORMATS[fmt]
    act_spec = FORMATS[act] if act else spec
    layer = QuantizedLinear.from_float(nn.Linear(16, 16), LinearQuantPolicy(
        act_spec, spec, spec, scaling=ScalingPolicy(mode="none"), quantized=roles))
    layer.scalers["weight"].scale.fill_(scale)
    return layer


def mixed_model(last_roles: tuple[str, ...] = ROLES) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(quantized("e5m2", 1.0), nn.Linear(16, 16), quantized("e3m4", 4.0, act="e2m5"),
                         quantized("e5m2", 0.5, roles=last_roles))


def test_diagnostics_update_metrics_over_mixed_formats(path):
    """Code moves run as one call per weight format; every layer still gets its own rates and
    histogram, and the model-wide rates count each weight once (two formats, a plain layer)."""
    model = mixed_model()
    diagnostics = Diagnostics(model, FORMATS["e5m2"])
    diagnostics.snapshot()
    before = {name: layer.weight.detach().clone() for name, layer in zip(("0", "1", "2", "3"), model, strict=True)}
    with torch.no_grad():
        for i, layer in enumerate(model):
            layer.weight.add_(torch.randn_like(layer.weight) * 10.0**-(i + 1) * (torch.rand_like(layer.weight) < 0.7))
    out, histograms = diagnostics.update_metrics()
    out = per_name(out)
    stalled = changed = moved = 0
    for name, layer in zip(("0", "1", "2", "3"), model, strict=True):
        if name == "1":
            moved += int((layer.weight != before[name]).sum())
            continue
        want = code_moves(before[name], layer.weight, layer.policy.weight, layer.scalers["weight"].scale)
        assert torch.equal(histograms[name], want["histogram"]), name
        assert out[f"quant/bit_stall_rate/{name}"].item() == pytest.approx(want["stalled"].item() / want["changed"].item())
        stalled, changed = stalled + int(want["stalled"]), changed + int(want["changed"])
    moved += changed
    assert 0 < stalled < changed
    assert out["quant/bit_stall_rate"].item() == pytest.approx(stalled / changed)
    assert out["quant/zero_update_frac"].item() == pytest.approx(1 - moved / (4 * 16 * 16))


def test_update_metrics_need_a_snapshot(path):
    """Without a snapshot there is nothing to compare the update with: a clear error, not a zip's."""
    with pytest.raises(RuntimeError, match="call snapshot first"):
        Diagnostics(mixed_model(), FORMATS["e5m2"]).update_metrics()


def test_weights_stored_in_their_format_need_the_kept_update_unless_none_is_quantized(path, make_config, tmp_path):
    """Weights stored in their format are compared through the raw update `keep_update` keeps:
    without it, or with one kept at an earlier step, a clear error. A model with no quantized layer has nothing to keep, and a run whose
    precision keeps every layer high trains with its weights 'stored in their format' as before."""
    diagnostics = Diagnostics(mixed_model(), FORMATS["e5m2"], stored_in_format=True)
    diagnostics.snapshot()
    with pytest.raises(RuntimeError, match="call keep_update before re-quantizing"):
        diagnostics.update_metrics()
    diagnostics.keep_update()
    diagnostics.update_metrics()
    diagnostics.snapshot()  # the next step's: the update kept before it is stale
    with pytest.raises(RuntimeError, match="this step's raw update: call keep_update"):
        diagnostics.update_metrics()
    plain = Diagnostics(nn.Sequential(nn.Linear(16, 16)), FORMATS["e5m2"], stored_in_format=True)
    plain.snapshot()
    plain.keep_update()
    assert per_name(plain.update_metrics()[0])["quant/bit_stall_rate"].item() == 0.0
    from altgrad.train import Trainer

    trainer = Trainer(make_config("quant.master_weights=format", "quant.precision=[{pattern: '*', format: bf16}]",
                                  "train.shadow_every=0"), tmp_path)
    assert not trainer.layers and trainer.train_step(1).metrics["quant/bit_stall_rate"] == 0.0


@pytest.mark.parametrize("last_roles", [ROLES, ("input", "weight")])
def test_diagnostics_quant_metrics_per_layer_and_overall(path, last_roles):
    """Overflow / underflow rates and codes used, from every layer's counters at once, equal the
    per-layer arithmetic (two formats, an activation format of its own, a plain layer between; a
    layer with its gradient role off averages codes used over the roles it quantizes)."""
    model = mixed_model(last_roles)
    diagnostics = Diagnostics(model, FORMATS["e5m2"])
    diagnostics.begin()
    model(torch.randn(64, 16) * 300).square().mean().backward()  # large: some activations overflow
    out = per_name(diagnostics.quant_metrics())
    diagnostics.end()
    totals = torch.zeros(3)
    by_pass = {"forward": torch.zeros(3), "backward": torch.zeros(3)}
    used_all = []
    for name, layer in zip(("0", "2", "3"), (model[0], model[2], model[3]), strict=True):
        counts = sum(layer.stats[r].counts()[0] for r in ROLES)
        totals += counts
        for role in ROLES:
            by_pass["backward" if role == "grad_output" else "forward"] += layer.stats[role].counts()[0]
        on = [r for r in ROLES if layer.policy.quantizes(r)]
        used = sum((layer.stats[r].counts()[1] > 0).sum().item() / layer.policy.format_of(r).num_finite_codes
                   for r in on) / len(on)
        used_all.append(used)
        assert out[f"quant/overflow_rate/{name}"].item() == pytest.approx((counts[0] / counts[2]).item())
        assert out[f"quant/underflow_rate/{name}"].item() == pytest.approx((counts[1] / counts[2]).item())
        assert out[f"quant/codes_used/{name}"].item() == pytest.approx(used)
    assert 0 < totals[0] and len({round(u, 6) for u in used_all}) == 3
    assert out["quant/overflow_rate"].item() == pytest.approx((totals[0] / totals[2]).item())
    assert out["quant/underflow_rate"].item() == pytest.approx((totals[1] / totals[2]).item())
    for p, c in by_pass.items():  # the forward's roles are the input and the weight, the backward's grad_output
        assert out[f"quant/{p}_overflow_rate"].item() == pytest.approx((c[0] / c[2]).item())
        assert out[f"quant/{p}_underflow_rate"].item() == pytest.approx((c[1] / c[2]).item())
    assert by_pass["forward"][0] > 0 and by_pass["backward"][1] > 0  # neither rate is a trivial 0
    assert out["quant/codes_used"].item() == pytest.approx(sum(used_all) / 3)
