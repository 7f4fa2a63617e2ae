"""Format-specific stability: stored-format weights, the emergency mantissa shift, partition clipping."""

from __future__ import annotations

import json
import math

import pytest
import torch

from altgrad.__main__ import main
from altgrad.config import StabilityConfig
from altgrad.experiment import read_jsonl
from altgrad.quant.quantize import quantize
from altgrad.train import Trainer
from altgrad.train.format_shift import layer_formats
from altgrad.train.stability import NAN_UNLOCALIZED, Event, StabilityMonitor
from altgrad.train.trainer import StepResult

# Stability policy, not compilation: the kernels run eagerly (bit-identical to the compiled ones,
# which test_quantize, test_linear and test_trainer cover); a format shift regroups the
# layers and would compile new graphs.
pytestmark = pytest.mark.usefixtures("eager_kernels")


class Interrupt(Exception):
    pass


def events(run_dir, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


def losses(run_dir) -> list[tuple[int, str]]:
    """(step, repr(train/loss)): repr round-trips a float exactly and makes NaN == NaN."""
    return [(int(r["step"]), repr(r["train/loss"])) for r in read_jsonl(run_dir / "metrics.jsonl")]


def step_counter(trainer: Trainer) -> list[int]:
    """[the step being trained], so hooks poison by step and a resumed run poisons the same ones."""
    current = [0]
    train_step = trainer.train_step

    def counted(step: int) -> StepResult:
        current[0] = step
        return train_step(step)

    trainer.train_step = counted
    return current


def poison(trainer: Trainer, weight_grad: str, weight_steps: set[int], output: str, output_steps: set[int]) -> None:
    """NaN weight gradients of one layer and an inf output of another, on the given steps."""
    current = step_counter(trainer)
    trainer.layers[weight_grad].weight.register_hook(
        lambda g: g * math.nan if current[0] in weight_steps else g)
    trainer.layers[output].register_forward_hook(
        lambda mod, inp, out: out * math.inf if mod.training and current[0] in output_steps else None)


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


def test_nan_streaks_shift_only_their_origin_layer_and_resume_is_exact(make_config, tmp_path):
    """Streak A (steps 2-3): NaN weight gradients of h.0.mlp.c_fc -> it alone shifts at step 3.
    Streak B (6-7): h.1.attn.c_attn's output is inf (NaN from its consumer on) -> it alone shifts
    at 7. The interrupted run resumes from the step-6 checkpoint, mid-streak B and after shift A,
    and must match the straight run bit for bit."""
    overrides = ("quant.format=e5m2", "stability.shift_patience=2", "train.max_steps=9",
                 "train.checkpoint_interval=3", "train.shadow_every=0", "train.diag_every=0",
                 "train.eval_interval=100")
    a, b = "h.0.mlp.c_fc", "h.1.attn.c_attn"

    def trainer(name: str) -> Trainer:
        t = Trainer(make_config(*overrides), tmp_path / name)
        poison(t, a, {2, 3}, b, {6, 7})
        return t

    def interrupt_at_8(metrics, ckpt):
        if metrics["step"] == 8:
            raise Interrupt

    straight = trainer("straight")
    straight.fit()
    with pytest.raises(Interrupt):
        trainer("resumed").fit(report=interrupt_at_8)
    resumed = trainer("resumed")
    resumed.fit(resume=tmp_path / "resumed")

    run_dir = tmp_path / "straight"
    skips = events(run_dir, "nan_skip")
    assert [(e["step"], e["where"], e["origin"]) for e in skips] == [
        (2, "backward", [a]), (3, "backward", [a]), (6, "forward", [b]), (7, "forward", [b])]
    shifts = [(e["step"], e["layer"], e["from"], e["to"], e["reason"]) for e in events(run_dir, "format_shift")]
    assert shifts == [(3, a, "e5m2", "e4m3", "nan"), (7, b, "e5m2", "e4m3", "nan")]
    rows = {int(r["step"]): r for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert [rows[s]["quant/format_shifts"] for s in (2, 3, 6, 7, 9)] == [0, 1, 1, 2, 2]
    assert rows[4]["stability/nan_streak"] == 0 and math.isfinite(rows[4]["train/loss"])
    assert "stability/nan_probe" not in rows[4]
    formats = torch.load(run_dir / "checkpoints/step_00000009/checkpoint.pt", weights_only=True)["formats"]
    assert {n: f["weight"] for n, f in formats.items() if f["weight"] != "e5m2"} == {a: "e4m3", b: "e4m3"}
    assert {n: f["input"] for n, f in formats.items() if f["input"] != "e5m2"} == {a: "e4m3", b: "e4m3"}

    resumed_dir = tmp_path / "resumed"
    assert [e["step"] for e in events(resumed_dir, "resume")] == [6]
    assert losses(resumed_dir) == losses(run_dir)  # bit for bit, NaN steps included
    for (key, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), key
    assert layer_formats(resumed.layers) == layer_formats(straight.layers) == formats


@pytest.mark.parametrize(("origins", "shifted"), [
    ([["h.0.mlp.c_fc"], ["lm_head", "h.0.mlp.c_fc"]], (["h.0.mlp.c_fc", "lm_head"], "nan")),  # union
    ([[], ["lm_head"]], (["lm_head"], "nan")),  # one traced step is enough
    ([[], []], (None, NAN_UNLOCALIZED)),  # nothing traced: every layer, and the event says why
])
def test_a_nan_streak_shifts_the_layers_traced_over_it(origins, shifted):
    monitor = StabilityMonitor(StabilityConfig(shift_patience=2))
    calls = []

    def shift(names, reason):
        calls.append((names, reason))
        return [Event("format_shift", reason)]

    bad = {"stability/loss_is_nan": 0.0, "stability/grad_has_nan": 1.0}
    monitor.observe_step(1, {"stability/loss_is_nan": 0.0, "stability/grad_has_nan": 0.0}, shift, [])
    for step, origin in enumerate(origins, start=2):
        events, stop = monitor.observe_step(step, bad, shift, origin)
        assert stop is None and events[0].extra["origin"] == origin
    assert calls == [shifted]
    assert monitor.nan_streak == 0 and monitor.nan_origins == [] and monitor.format_shifts == 1


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


@pytest.mark.parametrize(("extra", "expected"), [
    ((), ("completed", 8, None, None)),  # e7m0 + manifold at the cpu preset survives 8 steps
    (("optim.lr=1e30",), ("nan", 3, 2, "forward")),  # embeddings overflow: the loss is NaN at once
], ids=["default", "forced_collapse"])
def test_e7m0_runs_to_its_end_or_records_why_it_stopped(make_config, tmp_path, extra, expected):
    """Both outcomes, each checked against events.jsonl and metrics.jsonl."""
    cfg = make_config("quant.format=e7m0", "quant.master_weights=format", "optim.name=manifold",
                      "train.max_steps=8", "train.shadow_every=0", "train.diag_every=0",
                      "train.eval_interval=100", "stability.nan_patience=2", *extra)
    summary = Trainer(cfg, tmp_path).fit()
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (summary["stop_reason"], summary["steps"], summary["collapse_step"], summary["collapse_where"]) == expected

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [int(r["step"]) for r in rows] == list(range(1, summary["steps"] + 1))
    bad = [int(r["step"]) for r in rows if r["stability/loss_is_nan"] or r["stability/grad_has_nan"]]
    skips = events(tmp_path, "nan_skip")
    assert [e["step"] for e in skips] == bad
    stops = [e["step"] for e in events(tmp_path, "nan_stop")]
    if summary["stop_reason"] == "nan":
        assert bad[0] == summary["collapse_step"] and skips[0]["where"] == summary["collapse_where"]
        assert bad == list(range(summary["collapse_step"], summary["steps"] + 1))  # the fatal streak
        assert stops == [summary["steps"]] and not math.isfinite(rows[-1]["train/loss"])
        assert (tmp_path / f"checkpoints/anomaly_step_{summary['collapse_step']:08d}").is_dir()
    else:
        assert bad == [] and stops == [] and all(math.isfinite(r["train/loss"]) for r in rows)


def test_bit_tracker_sample_codes_are_each_layers_own():
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
        assert torch.equal(rows[i, len(MOVE_BINS):], want.float()), name
        assert torch.equal(rows[i, :len(MOVE_BINS)], histograms[name].float())


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
