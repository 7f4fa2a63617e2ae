"""Format-specific stability: stored-format weights, the emergency mantissa shift, partition clipping."""

from __future__ import annotations

import math

import pytest
import torch

from altgrad.__main__ import main
from altgrad.experiment import read_jsonl
from altgrad.quant.quantize import quantize
from altgrad.train import Trainer


class Interrupt(Exception):
    pass


def events(run_dir, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


def poison_backward(trainer: Trainer, calls: set[int]) -> None:
    """NaN gradients of one layer on the given backward calls (1-based)."""
    count = 0

    def hook(grad):
        nonlocal count
        count += 1
        return grad * math.nan if count in calls else grad

    trainer.model.transformer.h[0].mlp.c_fc.weight.register_hook(hook)


def test_format_master_weights_stay_on_the_grid(make_config, tmp_path):
    trainer = Trainer(make_config("quant.format=e3m4", "quant.master_weights=format",
                                  "train.max_steps=3", "train.shadow_every=0"), tmp_path)
    trainer.fit()
    for layer in trainer.layers.values():
        w = layer.weight.detach()
        assert torch.equal(w, quantize(w, layer.policy.weight, layer.scalers["weight"].scale))


def test_format_master_weights_with_the_baseline_is_a_cli_error(tmp_path, capsys):
    assert main(["train", "--set", "quant.format=bf16", "--set", "quant.master_weights=format",
                 "--out", str(tmp_path / "run"), "--quiet"]) == 2
    assert "master_weights" in capsys.readouterr().err


def test_nan_streak_shifts_formats_and_resume_keeps_them(make_config, tmp_path):
    overrides = ("quant.format=e5m2", "stability.shift_patience=2", "train.max_steps=12",
                 "train.checkpoint_interval=4", "train.shadow_every=0", "train.eval_interval=6")
    trainer = Trainer(make_config(*overrides), tmp_path)
    poison_backward(trainer, {5, 6})
    rows = {}

    def stop(metrics, ckpt):
        rows[int(metrics["step"])] = metrics
        if metrics["step"] == 10:
            raise Interrupt

    with pytest.raises(Interrupt):
        trainer.fit(report=stop)
    shifts = events(tmp_path, "format_shift")
    n_layers = len(trainer.layers)
    assert [e["step"] for e in shifts] == [6] * n_layers  # after exactly 2 NaN steps
    assert {(e["from"], e["to"]) for e in shifts} == {("e5m2", "e4m3")}
    assert rows[5]["quant/format_shifts"] == 0 and rows[10]["quant/format_shifts"] == n_layers
    assert rows[7]["stability/nan_streak"] == 0 and math.isfinite(rows[7]["train/loss"])

    resumed = Trainer(make_config(*overrides), tmp_path)
    summary = resumed.fit(resume=tmp_path)  # from step 8
    assert summary["stop_reason"] == "completed"
    assert {layer.policy.weight.name for layer in resumed.layers.values()} == {"e4m3"}
    assert {layer.policy.input.name for layer in resumed.layers.values()} == {"e4m3"}
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["quant/format_shifts"] == n_layers


def test_bit_stall_streak_shifts_the_stalled_layers(make_config, tmp_path):
    cfg = make_config("quant.format=e6m1", "quant.master_weights=format", "optim.lr=1e-5",
                      "stability.shift_patience=2", "stability.shift_stall_threshold=0.5",
                      "train.max_steps=4", "train.shadow_every=0")
    Trainer(cfg, tmp_path).fit()
    shifts = events(tmp_path, "format_shift")
    assert shifts and min(e["step"] for e in shifts) == 2
    assert all(e["reason"] == "bit_stall" and e["to"] == "e5m2" for e in shifts if e["step"] == 2)


def test_partition_clipping_bounds_each_layer(make_config, tmp_path):
    k = 0.5
    trainer = Trainer(make_config("quant.format=e4m3", "optim.partition_clip_k=0.5",
                                  "train.max_steps=5", "train.shadow_every=0"), tmp_path)
    clipper = trainer.clipper
    clip = clipper.clip_
    checked = []

    def checking_clip():
        limits = [k * h.amax_history.max() for h in clipper.histories]
        raw = [w.grad.abs().amax() for w in clipper.weights]
        clip()
        for w, h, limit, before in zip(clipper.weights, clipper.histories, limits, raw, strict=True):
            if limit > 0:
                assert w.grad.abs().amax() <= limit
                checked.append(bool(before > limit))
            assert h.amax_history[-1] == w.grad.abs().amax()  # recorded after clipping

    clipper.clip_ = checking_clip
    trainer.fit()
    assert checked and any(checked)  # something was actually clipped


def test_e7m0_runs_to_its_end_or_records_why_it_stopped(make_config, tmp_path):
    cfg = make_config("quant.format=e7m0", "quant.master_weights=format", "optim.name=manifold",
                      "train.max_steps=8", "train.shadow_every=0", "stability.nan_patience=2")
    summary = Trainer(cfg, tmp_path).fit()
    assert summary["stop_reason"] in ("completed", "nan")
    if summary["stop_reason"] == "nan":
        assert summary["collapse_step"] is not None


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
