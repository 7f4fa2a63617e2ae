"""E0M7 and E1M6 are one grid up to a factor 2: under per-tensor amax scaling they quantize alike.

This is why a sweep with the default scaling shows the same numbers for both (SPEC §2's gfloat
convention gives both formats bias 0); only `scaling.mode: none` tells them apart.
"""

from __future__ import annotations

import pytest
import torch

from altgrad.quant import FORMATS, quantize
from altgrad.quant.equivalence import power_of_two_shift, quantize_identically
from altgrad.quant.scaling import compute_scale


def sample() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g) * torch.logspace(-4, 4, 50_000)
    return x[torch.randperm(x.numel(), generator=g)]


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("amax", [None, 0.37, 1e-3])  # None: the tensor's own amax (dynamic)
def test_e0m7_and_e1m6_agree_under_amax_scaling(pow2, margin, amax):
    x = sample()
    amax = x.abs().max() if amax is None else torch.tensor(amax)
    out = {}
    for name in ("e0m7", "e1m6"):
        s = compute_scale(amax, name, margin=margin, pow2=pow2)
        out[name] = quantize(x * s, name) / s
    assert torch.equal(out["e0m7"], out["e1m6"])
    assert out["e0m7"].unique().numel() > 16  # many grid levels in use, not all saturated or flushed


def test_e0m7_and_e1m6_differ_without_scaling():
    x = sample()
    differ = (quantize(x, "e0m7") != quantize(x, "e1m6")).float().mean().item()
    assert differ > 0.5  # e1m6 reaches 127/32, e0m7 saturates at 127/64 and rounds twice as fine


def test_the_only_registered_twins_are_e0m7_and_e1m6():
    twins = [(a, b, k) for a in FORMATS for b in FORMATS if (k := power_of_two_shift(a, b)) is not None]
    assert twins == [("e0m7", "e1m6", 1)]
    assert quantize_identically("e1m6", "e0m7", amax_scaled=True)
    assert not quantize_identically("e0m7", "e1m6", amax_scaled=False)
    assert not quantize_identically("e2m5", "e1m6", amax_scaled=True)


def test_e0m7_and_e1m6_train_identically_under_amax_scaling(make_config, tmp_path, eager_kernels):
    """What lets the sweep run e1m6 once, as e0m7: the whole training is bit-identical, with the
    manifold optimizer's ULP steps and format-stored weights (the parts that read the format's
    grid outside the quantizer) included. Without scaling they differ (the test above)."""
    from altgrad.train import Trainer

    def losses(fmt: str) -> list[tuple[float, ...]]:
        cfg = make_config(f"quant.format={fmt}", "optim.name=manifold", "quant.master_weights=format",
                          "train.max_steps=5", "train.eval_interval=5", "train.shadow_every=0")
        rows = []
        Trainer(cfg, tmp_path / fmt).fit(report=lambda m, ckpt: rows.append(m))
        return [(r["train/loss"], r["val/loss"], r["train/grad_norm"], r["quant/bit_stall_rate"]) for r in rows]

    assert losses("e0m7") == losses("e1m6")
