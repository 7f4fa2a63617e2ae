"""Bit tracking (`altgrad.train.bit_tracking`): each layer's own sampled codes, written per
diagnostic step."""

from __future__ import annotations

import pytest
import torch

from altgrad.experiment import read_jsonl
from altgrad.quant import quantize
from altgrad.train import Trainer

pytestmark = pytest.mark.usefixtures("eager_kernels")


def test_bit_tracker_sample_codes_are_each_layers_own(path):
    """One encode call per format over all layers' samples: each layer still gets the codes of its
    own sampled weights, in its own format and scale (three layers, two formats, three scales)."""
    from torch import nn

    from altgrad.quant.codes import MOVE_BINS, encode
    from altgrad.quant.formats import FORMATS
    from altgrad.quant.linear import LinearQuantPolicy, QuantizedLinear, ScalingPolicy
    from altgrad.train.bit_tracking import BitTracker

    torch.manual_seed(0)
    layers = {}
    for name, fmt, scale in (("a", "e5m2", 1.0), ("b", "e3m4", 8.0), ("c", "e5m2", 0.3)):
        spec = FORMATS[fmt]
        layers[name] = QuantizedLinear.from_float(nn.Linear(24, 24, bias=False),
                                                  LinearQuantPolicy(spec, spec, spec, scaling=ScalingPolicy(mode="none")))
        layers[name].scalers["weight"].scale.fill_(scale)
    tracker = BitTracker(layers)
    histograms = {n: torch.arange(len(MOVE_BINS)) + i for i, n in enumerate(layers)}
    rows = tracker.observe(histograms)
    for i, (name, layer) in enumerate(layers.items()):
        sample = layer.weight.detach().flatten()[tracker.samples[name]]
        want = encode(sample, layer.policy.weight, layer.scalers["weight"].scale)
        assert torch.equal(rows[i, len(MOVE_BINS):], want.long()), name
        assert torch.equal(rows[i, :len(MOVE_BINS)], histograms[name])


def test_move_counts_above_float32s_integers_are_written_exactly(tmp_path):
    """A layer of over 2^24 weights (GPT-2's tied head: 38.6M) has counts float32 cannot hold:
    2^24 + 1 must reach bit_positions.jsonl as itself, through the step's one host read."""
    from torch import nn

    from altgrad.quant.codes import MOVE_BINS
    from altgrad.quant.formats import FORMATS
    from altgrad.quant.linear import LinearQuantPolicy, QuantizedLinear
    from altgrad.train.bit_tracking import BitTracker
    from altgrad.train.trainer import to_host

    spec = FORMATS["e4m3"]
    layers = {"head": QuantizedLinear.from_float(nn.Linear(8, 8, bias=False), LinearQuantPolicy(spec, spec, spec))}
    tracker = BitTracker(layers)
    counts = torch.tensor([2**24 + 1, 2**24 + 3, 0, 0, 0, 0, 0], dtype=torch.int32)
    assert len(counts) == len(MOVE_BINS)
    metrics, values = to_host({"loss": torch.tensor(2.5), ("a", "b"): counts[:2]}, tracker.observe({"head": counts}))
    assert metrics == {"loss": 2.5, "a": 2**24 + 1, "b": 2**24 + 3}  # a named count too
    assert tracker.rows(7, values)["layers"]["head"]["moved"] == [2**24 + 1, 2**24 + 3, 0, 0, 0, 0, 0]


def test_bit_positions_are_written_per_diagnostic_step(make_config, tmp_path):
    trainer = Trainer(make_config("quant.format=e5m2", "quant.master_weights=format",
                                  "optim.name=manifold", "optim.lr_ulp=2", "train.max_steps=3",
                                  "train.shadow_every=0"), tmp_path)
    trainer.fit()
    rows = read_jsonl(tmp_path / "bit_positions.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert set(row["layers"]) == set(trainer.layers)
        for name, layer in trainer.layers.items():
            assert sum(row["layers"][name]["moved"]) == layer.weight.numel()
            assert len(row["layers"][name]["sample_codes"]) == 16
    moved = rows[-1]["layers"]["h.0.mlp.c_fc"]["moved"]
    assert sum(moved[1:]) > 0  # the manifold steps move codes
    trajectory = [r["layers"]["h.0.mlp.c_fc"]["sample_codes"] for r in rows]
    assert trajectory[0] != trajectory[-1]


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_weights_stored_in_their_format_stall_by_the_codes_they_store(make_config, tmp_path, rounding):
    """With weights stored in their format, what a step keeps of its update is the re-quantized
    weight, and under `weight_rounding: stochastic` a step under half an ULP still moves a share of
    the weights by a code. Bit-stall (each layer's and the model's) and the bit positions' code
    moves count what the weights store: here read off the weights around the optimizer's step,
    with no diagnostics code."""
    trainer = Trainer(make_config("quant.format=e3m4", "quant.master_weights=format", f"quant.weight_rounding={rounding}",
                                  "optim.name=manifold", "optim.lr_ulp=0.4", "train.shadow_every=0"), tmp_path)
    seen: dict[str, dict[str, torch.Tensor]] = {}
    optimizer_step = trainer.optimizer.step

    def step() -> None:
        seen["old"] = {n: m.weight.detach().clone() for n, m in trainer.layers.items()}
        optimizer_step()
        seen["updated"] = {n: m.weight.detach().clone() for n, m in trainer.layers.items()}

    trainer.optimizer.step = step
    for s in (1, 2, 3):
        metrics = trainer.train_step(s).metrics
        row = read_jsonl(tmp_path / "bit_positions.jsonl")[-1]
        stalled = predicted = changed = 0
        for name, layer in trainer.layers.items():
            def code(w: torch.Tensor, layer=layer) -> torch.Tensor:
                return quantize(w, layer.policy.weight, layer.weight_scale)  # (step 1 starts off the grid)

            old, updated, stored = seen["old"][name], seen["updated"][name], layer.weight.detach()
            same_code = code(stored) == code(old)
            moved = updated != old
            stuck = moved & same_code
            assert metrics[f"quant/bit_stall_rate/{name}"] == pytest.approx(int(stuck.sum()) / int(moved.sum()), rel=1e-6)
            assert row["layers"][name]["moved"][0] == int(same_code.sum()), name
            stalled, changed = stalled + int(stuck.sum()), changed + int(moved.sum())
            predicted += int((moved & (code(updated) == code(old))).sum())  # the update, to nearest
        assert metrics["quant/bit_stall_rate"] == pytest.approx(stalled / changed, rel=1e-6)
        # to nearest, the stored codes are the update's; stochastically a share of the updates that
        # round back to nearest moves a code all the same (here 0.65-0.76 stalled against 0.87-0.98)
        if rounding == "nearest":
            assert stalled == predicted
        else:
            assert stalled < 0.9 * predicted
