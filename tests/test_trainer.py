"""The instrumented trainer on real EUR-Lex text: learning, exact resume, the NaN policy, metrics."""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
import time
from typing import get_args

import pytest
import torch
from bitwise import same_values
from host_reads import CPU_ONLY_READS, host_reads

from altgrad.__main__ import main
from altgrad.config import ConfigError, QuantConfig, StabilityConfig, load_config
from altgrad.experiment import BIT_POSITIONS_FILE, CHECKPOINT_FILE, read_jsonl
from altgrad.metrics import TOKENS_PER_S
from altgrad.optim import OPTIMIZERS
from altgrad.precision import BASELINE, PRECISION_PRESETS
from altgrad.quant import kernels
from altgrad.quant.convert import quantized_layers
from altgrad.quant.formats import FORMATS
from altgrad.quant.quantize import quantize
from altgrad.run_model import build_model
from altgrad.scaling_policy import AmaxAlgo, ScalingMode
from altgrad.train import Trainer
from altgrad.train import trainer as trainer_module
from altgrad.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    orphaned_writes,
    save_checkpoint,
    step_checkpoints,
)

# The trainer's behaviour, on eager kernels: compiling them cold costs minutes here, and the
# compiled kernels and step graph are checked against eager in test_kernels (and through `path`).
pytestmark = pytest.mark.usefixtures("eager_kernels")


class Interrupt(Exception):
    """Stands in for a killed process: raised from the report callback mid-run."""


def losses(run_dir) -> dict[int, float]:
    return {int(r["step"]): r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def test_training_lowers_validation_loss(make_config, tmp_path):
    cfg = make_config("quant.format=e4m3", "train.max_steps=30", "train.eval_interval=10",
                      "train.batch_size=8", "optim.lr=3e-3", "train.diag_every=0")
    summary = Trainer(cfg, tmp_path).fit()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    first, last = rows[0]["val/loss"], rows[-1]["val/loss"]
    assert summary["stop_reason"] == "completed" and summary["steps"] == 30
    assert last < first - 1.0, (first, last)  # ~10.8 (uniform over 50k tokens) falls fast
    assert summary["best_val_loss"] == pytest.approx(min(r["val/loss"] for r in rows))


def test_the_summary_says_when_the_first_step_ended_and_whether_the_step_compiled(make_config, tmp_path,
                                                                                 monkeypatch):
    """A sweep's slow trial says why: its time to first step (from the trainer's construction: data,
    model, compiling) and how its step ran -- here a step graph whose compiler fails, so eager."""
    def no_compiler(self):
        raise RuntimeError("no compiler here")

    monkeypatch.delenv("ALTGRAD_NO_COMPILE")
    monkeypatch.setattr(kernels.Compiled, "registry", [])  # this failing graph stays out of other tests
    monkeypatch.setattr(kernels.StepGraph, "_compile", no_compiler)
    prepare = trainer_module.prepare_dataset

    def slow_data(cfg):  # construction counts too: first_step_s is not timed from fit()
        time.sleep(1.0)
        return prepare(cfg)

    monkeypatch.setattr(trainer_module, "prepare_dataset", slow_data)
    start = time.perf_counter()
    trainer = Trainer(make_config("quant.format=bf16", "train.max_steps=3", "train.compile=true",
                                  "train.diag_every=0"), tmp_path)
    step = trainer.train_step

    def slow_first_and_last(n):
        time.sleep(0.5 if n in (1, 3) else 0)
        return step(n)

    trainer.train_step = slow_first_and_last
    constructed = time.perf_counter() - start
    with pytest.warns(RuntimeWarning, match="step graph"):
        summary = trainer.fit()
    elapsed = time.perf_counter() - start
    # from construction (its 1 s of data included) through step 1's sleep; ended before step 3's
    assert constructed + 0.5 <= summary["first_step_s"] <= elapsed - 0.5
    assert summary["compile"] == "eager (RuntimeError: no compiler here)"
    assert summary["autocast"] is False  # train.autocast is on, but there is no bf16 autocast on the CPU
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


@pytest.mark.parametrize(("step_graph", "said"), [(True, "compiled (step graph)"),
                                                   (False, "compiled (per-tensor kernels)")])
def test_the_summary_says_what_compiled(make_config, tmp_path, monkeypatch, step_graph, said):
    """Where nothing fell back to eager, the summary says which way the step ran compiled: one
    graph, or a kernel per quantizer, which a GPU pays host time for each of (issue 15). (The real
    step graph's summary is checked in test_kernels.)"""
    monkeypatch.setattr(trainer_module, "compile_status", lambda: "compiled")
    cfg = make_config("quant.format=bf16", "train.max_steps=3", f"train.compile={str(step_graph).lower()}")
    assert Trainer(cfg, tmp_path).fit()["compile"] == said


def test_same_seed_same_batches_across_formats(make_config, tmp_path, monkeypatch):
    seen: dict[str, list[torch.Tensor]] = {}
    from altgrad.data import TokenBatches

    original = TokenBatches.train_batch

    def recording(self, step):
        x, y = original(self, step)
        seen.setdefault(current, []).append(x.clone())
        return x, y

    monkeypatch.setattr(TokenBatches, "train_batch", recording)
    for current in ("e4m3", "e2m5", "bf16"):
        Trainer(
            make_config(f"quant.format={current}", "train.max_steps=4"), tmp_path / current
        ).fit()
    assert len(seen["e4m3"]) == 4
    for fmt in ("e2m5", "bf16"):
        assert all(torch.equal(a, b) for a, b in zip(seen["e4m3"], seen[fmt], strict=True))
    assert not torch.equal(seen["e4m3"][0], seen["e4m3"][1])


def test_every_seed_is_evaluated_on_the_same_tokens(make_config, tmp_path):
    """The validation set follows train.eval_iters (x batch_size windows of block_size tokens) and
    not the training seed, so two seeds' val losses differ only by what was learned."""
    a, b = (Trainer(make_config(f"train.seed={seed}", "train.eval_iters=3"), tmp_path / str(seed))
            for seed in (1, 2))
    assert len(a.val_batches) == 3 and all(x.shape == (4, 32) for x, _ in a.val_batches)
    for (xa, ya), (xb, yb) in zip(a.val_batches, b.val_batches, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.batches.train_batch(0)[0], b.batches.train_batch(0)[0])


def test_roles_and_grad_scaling_reach_every_quantized_layer(make_config):
    cfg = make_config("quant.format=e4m3", "quant.roles.grad_output=false", "quant.grad_scaling.mode=none")
    layers = quantized_layers(build_model(cfg)).values()
    assert layers and all(layer.policy.quantized == ("input", "weight") for layer in layers)
    assert all(layer.scalers["grad_output"].policy.mode == "none" and layer.scalers["weight"].policy.mode == "delayed"
               for layer in layers)


@pytest.mark.parametrize("interrupt_at", [9])
def test_resume_is_bit_identical(make_config, tmp_path, interrupt_at):
    """Stochastic rounding, delayed scaling, diagnostics and the shadow all in play; resumed from
    step 8, between two evaluations (5, 10) and two shadow steps (6, 9)."""
    overrides = (
        "quant.format=e3m4",
        "quant.rounding=stochastic",
        "train.max_steps=11",
        "train.checkpoint_interval=4",
        "train.shadow_every=3",
        "train.eval_interval=5",
    )
    straight = Trainer(make_config(*overrides), tmp_path / "straight")
    straight.fit()

    def stop(metrics, ckpt):
        if metrics["step"] == interrupt_at:
            raise Interrupt

    with pytest.raises(Interrupt):
        Trainer(make_config(*overrides), tmp_path / "resumed").fit(report=stop)
    resumed = Trainer(make_config(*overrides), tmp_path / "resumed")
    resumed.fit(resume=tmp_path / "resumed")

    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(b) == list(range(1, 12))  # redone steps replaced, not duplicated
    assert a == b  # bit for bit
    for (name, p), q in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert same_values(p, q), name
    events = read_jsonl(tmp_path / "resumed" / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "resume"] == [8]


def rows(run_dir) -> list[dict[str, float]]:
    """A run's metric rows without its timing (tokens/s)."""
    return [{k: v for k, v in r.items() if k != TOKENS_PER_S} for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_a_run_computes_with_the_threads_it_records_and_resumes_with_them(make_config, tmp_path):
    """The same config trains to other numbers on one thread than on two (reductions split
    differently: the premise, checked), so a run records its count in config.yaml and a resume
    computes with it: interrupted on one thread and resumed from the command line in a process
    whose own count is two, it ends where the uninterrupted one-thread run does."""
    overrides = ("quant.format=e4m3", "train.batch_size=8", "train.max_steps=8", "train.checkpoint_interval=4",
                 "train.eval_interval=4")  # 8 x 32 tokens: the activations' kurtosis sums differ on two threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        Trainer(make_config(*overrides), tmp_path / "one").fit()
        assert load_config(tmp_path / "one" / "config.yaml").train.threads == 1
        torch.set_num_threads(2)
        Trainer(make_config(*overrides), tmp_path / "two").fit()
        assert load_config(tmp_path / "two" / "config.yaml").train.threads == 2
        assert rows(tmp_path / "one") != rows(tmp_path / "two")

        def stop(metrics, ckpt):
            if metrics["step"] == 6:
                raise Interrupt

        torch.set_num_threads(1)
        with pytest.raises(Interrupt):
            Trainer(make_config(*overrides), tmp_path / "resumed").fit(report=stop)
        torch.set_num_threads(2)
        assert main(["train", "--resume", str(tmp_path / "resumed"), "--quiet"]) == 0
        assert rows(tmp_path / "resumed") == rows(tmp_path / "one")

        # a count the config names wins over the process's
        named = Trainer(make_config(*overrides, "train.threads=1"), tmp_path / "named")
        assert torch.get_num_threads() == 1 and named.cfg.train.threads == 1
    finally:
        torch.set_num_threads(before)


# The drawn runs: a 2-layer model, a few checkpoints' worth of steps.
DRAWN_RUN = ("model.n_layer=2", "model.n_head=2", "model.n_embd=16", "model.block_size=16", "train.batch_size=2",
             "train.max_steps=14")


def override(key: str, value: object) -> str:
    """`key=value` as `--set` reads it (YAML: true, false, null)."""
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={text}"


def drawn_config(make_config, seed: int):
    """A valid run config with every quantization, optimizer and schedule axis drawn at random
    (seeded), each from the values the config itself defines: a format, layer precision, rounding
    mode or optimizer added later is drawn too. Combinations the config refuses are drawn again.
    Returns it and a step to interrupt it at, after its first checkpoint."""
    rng = random.Random(seed)
    quant = QuantConfig.model_fields
    choices = {
        "quant.format": [*FORMATS, BASELINE], "quant.precision": list(PRECISION_PRESETS),
        "quant.grad_format": list(FORMATS), "quant.rounding": get_args(quant["rounding"].annotation),
        "quant.master_weights": get_args(quant["master_weights"].annotation),
        "quant.weight_rounding": get_args(quant["weight_rounding"].annotation),
        "quant.scaling.mode": get_args(ScalingMode), "quant.scaling.algo": get_args(AmaxAlgo),
        "quant.grad_scaling.mode": get_args(ScalingMode), "quant.clip_ste": [True, False],
        "quant.roles.input": [True, False], "optim.name": list(OPTIMIZERS),
        "optim.partition_clip_k": [None, 2.0], "optim.grad_clip": [None, 1.0],
        "stability.shift_patience": [None, 1], "model.bias": [True, False], "model.dropout": [0.0, 0.1],
        "train.diag_every": [0, 1, 3], "train.shadow_every": [0, 2, 5], "train.eval_interval": [3, 4, 7],
        "train.checkpoint_interval": [3, 4, 5],
    }
    while True:
        overrides = [override(key, rng.choice(values)) for key, values in choices.items()]
        try:
            cfg = make_config(*DRAWN_RUN, *overrides)
        except ConfigError:
            continue
        print("drawn:", *overrides)  # shown with a failure
        return cfg, rng.randint(cfg.train.checkpoint_interval, cfg.train.max_steps - 1)  # (after a checkpoint)


@pytest.mark.parametrize("seed", range(8))
def test_resume_is_bit_identical_for_drawn_configs(make_config, tmp_path, seed):
    """Exact resume as a property of every config, not of the few above: a run interrupted at a
    drawn step and resumed from its last checkpoint writes the same metric rows (all but tokens/s),
    the same bit positions and the same final state as the run that never stopped."""
    cfg, interrupt_at = drawn_config(make_config, seed)

    def stop(metrics, ckpt):
        if metrics["step"] == interrupt_at:
            raise Interrupt

    straight = Trainer(cfg, tmp_path / "straight")
    straight.fit()
    with pytest.raises(Interrupt):
        Trainer(cfg, tmp_path / "resumed").fit(report=stop)
    resumed = Trainer(cfg, tmp_path / "resumed")
    resumed.fit(resume=tmp_path / "resumed")

    def rows(run):
        return [{k: v for k, v in r.items() if k != TOKENS_PER_S} for r in read_jsonl(tmp_path / run / "metrics.jsonl")]

    a, b = rows("straight"), rows("resumed")
    assert [r["step"] for r in b] == list(range(1, cfg.train.max_steps + 1))
    for x, y in zip(a, b, strict=True):  # NaN == NaN here: a row is compared as its JSON text
        assert json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True), x["step"]

    def bit_positions(run):  # (None: no file, as without diagnostics)
        path = tmp_path / run / BIT_POSITIONS_FILE
        return path.read_text() if path.exists() else None

    assert bit_positions("straight") == bit_positions("resumed")
    # bit for bit, NaN matching NaN: a skipped step leaves one in a scaler's raw amax
    for (name, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert same_values(p, q), name


def nan_gradients_from(trainer: Trainer, backward: int) -> None:
    """From the `backward`-th backward on, every gradient of h.0's first MLP weight is NaN."""
    calls = 0

    def poison(grad):
        nonlocal calls
        calls += 1
        return grad * math.nan if calls >= backward else grad

    trainer.model.transformer.h[0].mlp.c_fc.weight.register_hook(poison)


def test_nan_gradients_are_skipped_then_stop_the_run(make_config, tmp_path):
    cfg = make_config("quant.format=e4m3", "train.max_steps=30", "stability.nan_patience=3")
    trainer = Trainer(cfg, tmp_path)
    nan_gradients_from(trainer, 5)
    weights = {}

    def snapshot(metrics, ckpt):
        weights[int(metrics["step"])] = (
            trainer.model.transformer.h[0].mlp.c_fc.weight.detach().clone()
        )

    summary = trainer.fit(report=snapshot)
    assert summary["stop_reason"] == "nan"
    assert (
        summary["steps"] == 7
        and summary["collapse_step"] == 5
        and summary["collapse_where"] == "backward"
    )
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert torch.equal(weights[4], weights[7])  # skipped steps leave the weights alone
    assert not torch.equal(weights[3], weights[4])
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert (
        kinds.count("nan_skip") == 3 and kinds[-1] == "nan_stop" and "anomaly_checkpoint" in kinds
    )
    anomaly = torch.load(
        tmp_path / "checkpoints" / "anomaly_step_00000005" / CHECKPOINT_FILE, weights_only=True
    )
    assert anomaly["step"] == 4
    assert torch.equal(anomaly["model"]["transformer.h.0.mlp.c_fc.weight"], weights[4])
    streaks = [r["stability/nan_streak"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert streaks[-3:] == [1.0, 2.0, 3.0]


def same_state(a, b) -> bool:
    """Two checkpoint dicts equal entry for entry, tensors bit for bit (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(
            torch.nan_to_num(a) if a.is_floating_point() else a, torch.nan_to_num(b) if b.is_floating_point() else b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("weights", ["quant.master_weights=fp32", "quant.master_weights=format"])
def test_the_anomaly_checkpoint_is_the_state_the_first_nan_step_started_from(make_config, tmp_path, weights):
    """SPEC §5's save-on-anomaly: the checkpoint saved at the first non-finite step is the state it
    started from, the checkpoint the step before wrote, entry for entry, not what the skipped step
    left: its forward recorded amaxes in the scalers' histories, it set its learning rate, and the
    monitor counted it (resumed from there, the run stopped a step early)."""
    cfg = make_config("quant.format=e4m3", "train.max_steps=12", "stability.nan_patience=3",
                      "train.checkpoint_interval=1", "train.keep_last=20", "optim.partition_clip_k=4", weights)
    trainer = Trainer(cfg, tmp_path)
    nan_gradients_from(trainer, 5)
    assert trainer.fit()["steps"] == 7
    before = torch.load(tmp_path / "checkpoints" / "step_00000004" / CHECKPOINT_FILE, weights_only=True)
    anomaly = torch.load(tmp_path / "checkpoints" / "anomaly_step_00000005" / CHECKPOINT_FILE, weights_only=True)
    assert same_state(anomaly, before)
    after = torch.load(tmp_path / "checkpoints" / "step_00000005" / CHECKPOINT_FILE, weights_only=True)
    assert not same_state(after["model"], before["model"])  # (the skipped step did change these)


@pytest.mark.parametrize("patience", [1, 2])
def test_one_anomaly_checkpoint_per_run_of_nan_steps_whatever_the_format_shifts(make_config, tmp_path, patience):
    """Emergency shifts reset the NaN streak, not the run of non-finite steps: its first step is
    saved (with shift_patience 1 it was not, a later one was instead), and once (with 2, every
    other step was)."""
    cfg = make_config("quant.format=e4m3", "train.max_steps=16", "stability.nan_patience=2",
                      f"stability.shift_patience={patience}")
    trainer = Trainer(cfg, tmp_path)
    nan_gradients_from(trainer, 5)  # from step 5 on, whatever the format
    trainer.fit()
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert "format_shift" in kinds and kinds.count("anomaly_checkpoint") == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("anomaly_*")) == ["anomaly_step_00000005"]


SPEC_METRICS = [
    "train/loss",
    "train/ppl",
    "train/grad_norm",
    "train/lr",
    "train/tokens_per_s",
    "val/loss",
    "val/ppl",
    "quant/overflow_rate",
    "quant/underflow_rate",
    "quant/bit_stall_rate",
    "quant/zero_update_frac",
    "quant/codes_used",
    "shadow/cos_mean",
    "shadow/cos_min",
    "stability/nan_streak",
    "stability/loss_is_nan",
    "stability/grad_has_nan",
    "stability/divergence",
]
PER_LAYER = [
    "grad/l2",
    "grad/linf",
    "grad/snr",
    "grad/dead_frac",
    "act/kurtosis",
    "shadow/cos",
    "quant/overflow_rate",
    "quant/bit_stall_rate",
]


@pytest.mark.parametrize("stopped_at", [3, 7])
def test_a_run_stopped_from_outside_keeps_its_summary(make_config, tmp_path, stopped_at):
    """Tune stops a trial inside `report` (SystemExit in the trial's process): its summary.json
    still says how far it ran and what its trainer saw, a NaN collapse included (here the
    trainer's own stop at step 7 is also the step Tune stops it at)."""
    cfg = make_config("quant.format=e4m3", "train.max_steps=30", "stability.nan_patience=3",
                      "train.checkpoint_interval=100")
    trainer = Trainer(cfg, tmp_path)
    nan_gradients_from(trainer, 5)

    def tune_stops(metrics, ckpt):
        if metrics["step"] == stopped_at:
            raise SystemExit(0)

    with pytest.raises(SystemExit):
        trainer.fit(report=tune_stops)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == stopped_at and summary["wall_time_s"] > 0
    if stopped_at == 7:  # the trainer's own stop, at the step Tune stopped it: the run's own ending
        assert (summary["status"], summary["stop_reason"]) == ("finished", "nan")
        assert (summary["collapse_step"], summary["collapse_where"]) == (5, "backward")
    else:
        assert (summary["status"], summary["stop_reason"], summary["collapse_step"]) == ("stopped", None, None)


def test_a_crash_is_not_recorded_as_a_stop(make_config, tmp_path):
    """Only Tune's stop and Ctrl-C are "stopped": an error leaves the last checkpoint's summary."""
    trainer = Trainer(make_config("quant.format=e4m3", "train.max_steps=30", "train.checkpoint_interval=2"), tmp_path)

    def crash(metrics, ckpt):
        if metrics["step"] == 3:
            raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        trainer.fit(report=crash)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("running", 2)


@pytest.mark.parametrize("optimizer", ["adamw", "manifold"])
def test_a_step_reads_no_value_back_to_the_host(make_config, tmp_path, path, optimizer):
    """SPEC §5: one host sync per step, the trainer's read of everything the step measured. On the
    CPU that read is a `tolist`, which is no ATen op, so any other read the profiler sees is one a
    GPU would sync on: here with every diagnostic, the shadow and an evaluation in the step,
    stochastic rounding, weights stored in the format and partition-relative clipping, on the
    compiled kernels (whose decompositions can read: `_foreach_add_` of a 0-dim tensor did) and
    the eager ones. tests/test_cuda.py counts the syncs themselves, when a GPU is at hand."""
    trainer = Trainer(make_config("model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=8",
                                  "quant.format=e3m4", "quant.rounding=stochastic", "quant.master_weights=format",
                                  "quant.weight_rounding=stochastic", f"optim.name={optimizer}",
                                  "optim.partition_clip_k=2.0", "train.diag_every=1", "train.shadow_every=1",
                                  "train.eval_interval=4"), tmp_path)
    for step in (1, 2, 3):
        trainer.train_step(step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train_step(4)
    reads = host_reads(prof.events())
    assert set(reads) <= CPU_ONLY_READS, reads


def test_every_spec_metric_is_present_and_finite(make_config, tmp_path):
    cfg = make_config(
        "quant.format=e4m3", "quant.precision=mlp", "train.max_steps=3", "train.shadow_every=1"
    )
    Trainer(cfg, tmp_path).fit()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for row in rows:
        for key in SPEC_METRICS:
            assert key in row and math.isfinite(row[key]), key
        for prefix in PER_LAYER:
            layer_keys = [k for k in row if k.startswith(prefix + "/")]
            assert layer_keys and all(math.isfinite(row[k]) for k in layer_keys), prefix
        # mlp policy: only MLP layers carry quantizer counters, every linear carries gradients
        assert {k.split("/")[-1] for k in row if k.startswith("quant/overflow_rate/")} == {
            "h.0.mlp.c_fc",
            "h.0.mlp.c_proj",
            "h.1.mlp.c_fc",
            "h.1.mlp.c_proj",
        }
        assert "grad/l2/h.0.attn.c_attn" in row and "grad/l2/lm_head" in row
        assert 0 < row["quant/codes_used"] <= 1 and 0.9 < row["shadow/cos_mean"] <= 1.0


def test_the_shadow_cosine_of_equal_gradients_is_one(make_config, tmp_path):
    """A model that quantizes nothing, without autocast, computes the FP32 shadow's own gradients:
    every layer's cosine is 1 exactly. (Summed in float32 over the tied head's 3.2M gradients the
    cosine came out above 1, wrong by as much as the formats' cosines differ.)"""
    trainer = Trainer(make_config("quant.format=bf16", "train.autocast=false", "train.shadow_every=1",
                                  "train.diag_every=0"), tmp_path)
    row = trainer.train_step(2).metrics
    cosines = {k: v for k, v in row.items() if k.startswith("shadow/cos/")}
    assert "shadow/cos/lm_head" in cosines and all(v == 1.0 for v in cosines.values()), cosines


def test_checkpoint_retention_and_corrupt_fallback(make_config, tmp_path):
    overrides = (
        "quant.format=e5m2",
        "train.max_steps=25",
        "train.checkpoint_interval=5",
        "train.eval_interval=5",
        "train.diag_every=0",  # (what a checkpoint holds of them is checked by the exact-resume tests)
        "train.shadow_every=0",
    )
    Trainer(make_config(*overrides), tmp_path).fit()
    kept = [p.name for p in step_checkpoints(tmp_path / "checkpoints")]
    best = json.loads((tmp_path / "checkpoints" / "best.json").read_text())["name"]
    assert kept[-2:] == ["step_00000020", "step_00000025"] and best in kept and len(kept) <= 3

    newest = tmp_path / "checkpoints" / "step_00000025" / CHECKPOINT_FILE
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated by a dying writer
    Trainer(make_config(*overrides), tmp_path).fit(resume=tmp_path)
    events = read_jsonl(tmp_path / "events.jsonl")
    skipped = [e for e in events if e["kind"] == "checkpoint_skipped"]
    assert skipped and str(newest) in skipped[0]["message"]
    assert [e["step"] for e in events if e["kind"] == "resume"] == [20]

    for p in step_checkpoints(tmp_path / "checkpoints"):
        (p / CHECKPOINT_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=CHECKPOINT_FILE):
        Trainer(make_config(*overrides), tmp_path).fit(resume=tmp_path)


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_0(make_config, tmp_path, capsys):
    """--resume of a run stopped before its first checkpoint (a kill at step 3 of a 5-step interval)
    has nothing to continue from: it trains the run again in its own directory, with its own config,
    and ends as the run that never stopped, row for row."""
    overrides = ("quant.format=e4m3", "train.max_steps=8", "train.checkpoint_interval=5", "train.eval_interval=4")
    Trainer(make_config(*overrides), tmp_path / "whole").fit()

    def stop(metrics, ckpt):
        if metrics["step"] == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        Trainer(make_config(*overrides), tmp_path / "cut").fit(report=stop)
    assert not step_checkpoints(tmp_path / "cut" / "checkpoints") and len(rows(tmp_path / "cut")) == 3
    assert main(["train", "--resume", str(tmp_path / "cut"), "--quiet"]) == 0
    assert "no checkpoint yet (stopped before its first): training it again from step 0" in capsys.readouterr().err
    assert rows(tmp_path / "cut") == rows(tmp_path / "whole")


def test_a_checkpoint_writer_killed_mid_write_leaves_no_folder_behind(tmp_path):
    """kill -9 while a checkpoint is written (a spot instance's end) leaves the writer's temporary
    folder, a checkpoint's worth of disk that nothing renames: the next checkpoint a run saves
    removes it. A folder another live process is still writing stays."""
    root = tmp_path / "checkpoints"
    writer = ("import sys, time, torch; from pathlib import Path; from altgrad.train.checkpoint import save_checkpoint;"
              "torch.save = lambda *a, **k: (print('writing', flush=True), time.sleep(600));"
              "save_checkpoint(Path(sys.argv[1]) / 'step_{:08d}'.format(int(sys.argv[2])), {})")
    killed = subprocess.Popen([sys.executable, "-c", writer, str(root), "18"], stdout=subprocess.PIPE, text=True)
    alive = subprocess.Popen([sys.executable, "-c", writer, str(root), "24"], stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout.readline() == "writing\n" and alive.stdout.readline() == "writing\n"
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        left = sorted(p.name for p in root.iterdir())
        assert left == [f".step_00000018.tmp-{killed.pid}", f".step_00000024.tmp-{alive.pid}"]
        assert [p.name for p in orphaned_writes(root)] == [left[0]]
        CheckpointManager(tmp_path, keep_last=2).save(30, {"step": 30, "model": {}}, val_loss=None)
        assert sorted(p.name for p in root.iterdir()) == [left[1], "step_00000030"]
    finally:
        alive.kill()
        alive.wait()


def test_the_best_checkpoint_survives_a_writer_killed_before_best_json_and_a_corrupt_one(tmp_path):
    """kill -9 after a checkpoint's rename and before `best.json` named it (the best so far): the
    resumed run's saves still rank it by its own `meta.json`, and retention keeps it. A corrupt
    `best.json` is rewritten, not a traceback; a checkpoint saved before any evaluation (val NaN)
    is never the best."""
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(3, {"step": 3, "model": {}}, val_loss=math.nan)  # no evaluation yet
    manager.save(5, {"step": 5, "model": {}}, val_loss=1.0)
    (root / "best.json").unlink()  # killed before it was written
    for step, val in ((10, 2.0), (15, 3.0), (20, 1.0)):  # step 20 ties: the earlier stays the best
        manager.save(step, {"step": step, "model": {}}, val_loss=val)
    assert [p.name for p in step_checkpoints(root)] == ["step_00000005", "step_00000015", "step_00000020"]
    assert json.loads((root / "best.json").read_text()) == {"name": "step_00000005", "step": 5, "val_loss": 1.0}
    (root / "best.json").write_text('{"name": "step_00000020"}')  # no step, no val loss: ranks nothing
    manager.save(24, {"step": 24, "model": {}}, val_loss=0.7)
    (root / "best.json").write_text('{"name": "step_0000')  # torn
    manager.save(25, {"step": 25, "model": {}}, val_loss=0.5)
    assert json.loads((root / "best.json").read_text())["name"] == "step_00000025"
    assert [p.name for p in step_checkpoints(root)] == ["step_00000024", "step_00000025"]
    # a checkpoint written before meta.json existed ranks by the best.json of its day
    old = save_checkpoint(root / "step_00000002", {"step": 2, "model": {}})
    (root / "best.json").write_text(json.dumps({"name": old.name, "step": 2, "val_loss": 0.1}))
    manager.save(30, {"step": 30, "model": {}}, val_loss=0.4)
    assert old.is_dir() and json.loads((root / "best.json").read_text())["name"] == old.name


def test_kurtosis_matches_its_definition(path):
    """Pearson kurtosis of an activation: 1.8 for a uniform, 3 for a normal, and exactly 1 for two
    equally frequent values."""
    from altgrad.train.diagnostics import kurtosis

    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(4096, 64, generator=g), torch.randn(512, 256, generator=g),
          torch.tensor([-2.0, 6.0] * 50).view(10, 10)]
    got = torch.stack([kurtosis(x) for x in xs])
    for x, k in zip(xs, got, strict=True):
        d = x.double().flatten() - x.double().mean()
        assert k.item() == pytest.approx((d**4).mean().item() / (d**2).mean().item() ** 2, rel=1e-4)
    assert got[0].item() == pytest.approx(1.8, abs=0.02) and got[1].item() == pytest.approx(3.0, abs=0.05)
    assert got[2].item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("fmt", ["e5m2", "e2m5", "e7m0"])
def test_gradient_stats_match_their_definitions(fmt, path):
    """The fused gradient statistics against plain torch: norms, dead fraction and the SQNR of the
    gradient quantized at its own amax scale."""
    from altgrad.quant import compute_scale, get_format, quantize
    from altgrad.train.diagnostics import gradient_stats

    f = get_format(fmt)
    g = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * 1e-3
    g[::7] = 0
    stats = gradient_stats([g, torch.tensor([0.0, 3.0, -4.0])], f)  # one call for both
    assert stats[1, :3].tolist() == [5.0, 4.0, pytest.approx(1 / 3)]
    l2, linf, dead, snr = stats[0].tolist()
    q = quantize(g, f, compute_scale(g.abs().max(), f))
    want_snr = 20 * math.log10(g.norm() / (g - q).norm())
    assert linf == g.abs().max().item() and dead == pytest.approx((g == 0).float().mean().item())
    assert l2 == pytest.approx(g.norm().item(), rel=1e-5)
    assert snr == pytest.approx(want_snr, rel=1e-4)


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


def test_a_resume_may_spell_the_precision_otherwise_but_not_change_the_formats(make_config, tmp_path):
    """The checkpoint's layer formats replace a resumed run's, so a resume that would quantize other
    layers or formats is refused (its records would name what it never trained); a precision
    written otherwise that assigns the same formats (`all` as a rule list) is the same run."""
    overrides = ("quant.format=e4m3", "train.max_steps=4", "train.checkpoint_interval=2", "train.diag_every=0")
    Trainer(make_config(*overrides), tmp_path).fit()
    spelled = "quant.precision=[{pattern: '*', format: '{fmt}'}]"
    assert Trainer(make_config(*overrides, spelled, "train.max_steps=6"), tmp_path).fit(resume=tmp_path)["steps"] == 6
    for changed in ("quant.precision=mlp", "quant.format=e5m2"):
        with pytest.raises(ConfigError, match="a run's formats do not change on resume"):
            Trainer(make_config(*overrides, changed, "train.max_steps=8"), tmp_path).fit(resume=tmp_path)


def test_a_monitor_from_a_checkpoint_inside_a_nan_streak_does_not_open_a_new_run_of_them():
    """A checkpoint written before the monitor kept `last_finite`, inside a streak: the next NaN step
    continues the run of them (no second anomaly checkpoint); outside a streak it opens one."""
    from altgrad.train.stability import StabilityMonitor

    nan = {"stability/loss_is_nan": 1.0, "stability/grad_has_nan": 0.0}
    for streak, opens in ((2, False), (0, True)):
        monitor = StabilityMonitor(StabilityConfig(), stall_shifts=False)
        old = monitor.state_dict()
        del old["last_finite"]
        monitor.load_state_dict({**old, "nan_streak": streak})
        assert monitor.opens_nan_run(nan) is opens
