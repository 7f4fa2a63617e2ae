"""The emergency mantissa shift (`altgrad.train.format_shift`): which layers a NaN or bit-stall
streak shifts, and exact resume across a shift."""

from __future__ import annotations

import math

import pytest
import torch
from bitwise import same_values

from altgrad.config import StabilityConfig
from altgrad.experiment import read_jsonl
from altgrad.metrics import layer_values
from altgrad.train import Trainer
from altgrad.train.format_shift import layer_formats
from altgrad.train.stability import NAN_UNLOCALIZED, Event, StabilityMonitor
from altgrad.train.trainer import StepResult

# Stability policy, not compilation: the kernels run eagerly (bit-identical to the compiled ones,
# which test_quantize, test_linear and test_kernels cover); a format shift regroups the
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
        assert same_values(p, q), key
    assert layer_formats(resumed.layers) == layer_formats(straight.layers) == formats


@pytest.mark.parametrize(("origins", "shifted"), [
    ([["h.0.mlp.c_fc"], ["lm_head", "h.0.mlp.c_fc"]], (["h.0.mlp.c_fc", "lm_head"], "nan")),  # union
    ([[], ["lm_head"]], (["lm_head"], "nan")),  # one traced step is enough
    ([[], []], (None, NAN_UNLOCALIZED)),  # nothing traced: every layer, and the event says why
])
def test_a_nan_streak_shifts_the_layers_traced_over_it(origins, shifted):
    monitor = StabilityMonitor(StabilityConfig(shift_patience=2), stall_shifts=False)
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


@pytest.mark.parametrize("master", ["format", "fp32"])
def test_bit_stall_streak_shifts_the_stalled_layers_of_format_stored_weights(make_config, tmp_path, master):
    """Weights stored in their format lose the updates a stalled layer rounds away: it shifts. With
    fp32 master weights the master keeps them, so the same stall shifts nothing (it shifted every
    layer of a healthy e5m2 run, its head down to e1m6 in 160 steps: docs/design.md)."""
    cfg = make_config("quant.format=e6m1", f"quant.master_weights={master}", "optim.lr=1e-5",
                      "stability.shift_patience=2", "stability.shift_stall_threshold=0.5",
                      "train.max_steps=4", "train.shadow_every=0", "train.diag_every=1")
    Trainer(cfg, tmp_path).fit()
    stalled = [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")
               if max(layer_values("quant/bit_stall_rate", row).values()) > 0.5]
    assert stalled[:2] == [1, 2]  # the premise: a layer stalled for the patience, either way
    shifts = events(tmp_path, "format_shift")
    if master == "fp32":
        assert shifts == []
        return
    assert shifts and min(e["step"] for e in shifts) == 2
    assert all(e["reason"] == "bit_stall" and e["to"] == "e5m2" for e in shifts if e["step"] == 2)
