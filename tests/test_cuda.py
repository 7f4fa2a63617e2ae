"""The CUDA path: inductor's Triton kernels must be bit-identical to the CPU reference, and the
trainer must run on the GPU as the gpu preset does (bf16 autocast) with one host sync per step.
Skipped without CUDA; run them on a GPU machine (`pytest tests/test_cuda.py`)."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from bitwise import edge_values, ordinal, random_values, same_values
from compiled_steps import (
    MIXED,
    STOCHASTIC,
    TINY,
    assert_exact_resume,
    assert_step_identical,
    eager_and_compiled,
)
from torch._dynamo.utils import counters

from altgrad.experiment import BIT_POSITIONS_FILE, read_jsonl
from altgrad.quant import FORMATS, code_moves, compile_status, decode, encode, quantize
from altgrad.quant.kernels import Kernel
from altgrad.quant.scaling import TensorScaler
from altgrad.quant.step import TensorStats
from altgrad.scaling_policy import ScalingPolicy
from altgrad.train import Trainer
from altgrad.train.format_shift import shift_layers
from altgrad.train.replay import ReplayedCall

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


def cpu_reference(monkeypatch, fn):
    """fn() on the eager CPU kernels (the ones the quantizer tests check against gfloat)."""
    monkeypatch.setenv("ALTGRAD_NO_COMPILE", "1")
    try:
        return fn()
    finally:
        monkeypatch.delenv("ALTGRAD_NO_COMPILE")


def graph_launches(fn) -> int:
    """How many CUDA graphs fn() launched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.name == "cudaGraphLaunch" for e in prof.events())


def cudagraph_skips() -> int:
    """Graphs inductor compiled without CUDA graphs that were asked for (a mutated input that is no
    parameter or buffer, an op a graph cannot hold), so far in this process. A skip is only a
    warning, and the replayed forward alone would still launch graphs: with none skipped, the
    backward (compiled with the forward) replays too."""
    return counters["inductor"]["cudagraph_skips"]


# (train.compile, train.cuda_graphs): the per-tensor kernels, the step graph, the step graph replayed
STEPS = {"per-tensor": (False, False), "step-graph": (True, False), "cuda-graphs": (True, True)}


# ... and the optimizer: the manifold optimizer's compiled update once read a value back (`.item()`)
SYNC_CASES = {**{name: (*step, "adamw") for name, step in STEPS.items()},
              "per-tensor-manifold": (False, False, "manifold")}


@pytest.mark.parametrize("compiled, cuda_graphs, optimizer", SYNC_CASES.values(), ids=SYNC_CASES.keys())
def test_a_cuda_training_step_syncs_with_the_host_once(make_config, tmp_path, recwarn, monkeypatch, compiled,
                                                       cuda_graphs, optimizer):
    """SPEC §5: one host sync per step, diagnostics included (bincount, .item(), a Python branch on
    a tensor would each add one), with the per-tensor kernels and with the step graph the gpu
    preset trains with, launched kernel by kernel or replayed as CUDA graphs (the first step warms
    the step graph up and the second records it, each syncing; the diagnostics' calls, replayed
    too, record at the third: the fourth is the first step that only replays), and with either
    optimizer. And no kernel falls back to eager at dynamo's recompile limit (autocast state,
    Parameter vs Tensor or rank each made a new graph before)."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    model = TINY if compiled else ()  # the step graph's compile: seconds for one layer
    trainer = Trainer(make_config(*model, "quant.format=e4m3", f"optim.name={optimizer}", "train.device=cuda",
                                  "train.autocast=true",
                                  "train.diag_every=1", "train.shadow_every=1", f"train.compile={compiled}",
                                  f"train.cuda_graphs={cuda_graphs}"), tmp_path)
    skips = cudagraph_skips()
    # (config.patch, not monkeypatch: undoing a monkeypatch deletes a torch config entry)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for step in (2, 3, 4):
            trainer.train_step(step)
        torch.cuda.synchronize()
        recwarn.clear()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step(5)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        launches = graph_launches(lambda: trainer.train_step(6))
    syncs = [w for w in recwarn if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert compile_status() == "compiled"
    assert not compiled or trainer.forward.graphs == 1
    # forward and backward, each one graph or more (inductor partitions a graph around its CPU ops;
    # `cudagraph_skips` says the backward's are among them), and the diagnostics' three calls
    assert (launches >= 2 + len(REPLAYED)) if cuda_graphs else (launches == 0), launches
    assert cudagraph_skips() == skips
    assert all(replayed(trainer)[name] >= cuda_graphs for name in REPLAYED)


# The calls outside the step graph that a diagnostic step replays as CUDA graphs (`ReplayedCall`).
REPLAYED = ("after_backward", "after_update", "observe")


def replayed(trainer: Trainer) -> dict[str, int]:
    """How often each of a trainer's `REPLAYED` calls replayed a CUDA graph (0: never recorded),
    each failing the test if its recording failed or if it keeps more than one per step graph."""
    calls = {"after_backward": trainer.diagnostics.after_backward, "after_update": trainer.diagnostics.after_update,
             "observe": trainer.bit_tracker.observe}
    out = {}
    for name, call in calls.items():
        if not isinstance(call, ReplayedCall):
            out[name] = 0
            continue
        assert call.error is None, (name, call.error)
        assert len(call.graphs) <= trainer.forward.graphs, (name, len(call.graphs))
        out[name] = call.replays
    return out


def test_a_replayed_call_reads_its_tensors_as_they_are_and_records_anew_where_they_moved():
    """`ReplayedCall` runs its first call, records at the second with the same tensors and replays
    from then on, reading what the tensors hold at each replay; a tensor elsewhere, or another value
    of what decides the kernels, is a call of its own (run, then recorded); a call that cannot be
    recorded (a read back to the host) warns and runs kernel by kernel from then on, with the right
    result."""
    x = torch.randn(1000, device=CUDA)
    double = ReplayedCall(lambda t: t * 2 + 1, lambda t: [t])
    outputs = [double(x).clone() for _ in range(3)]
    assert all(torch.equal(out, x * 2 + 1) for out in outputs)
    assert double.replays == 2 and len(double.graphs) == 1
    x.mul_(-3.0)
    assert torch.equal(double(x), x * 2 + 1) and double.replays == 3
    y = torch.randn(500, device=CUDA)
    assert torch.equal(double(y), y * 2 + 1) and double.replays == 3  # run as it is
    assert torch.equal(double(y), y * 2 + 1) and double.replays == 4 and len(double.graphs) == 2
    assert torch.equal(double(x), x * 2 + 1) and double.replays == 5  # the first recording still stands

    factor = {"value": 2.0}  # what decides the kernels, not a tensor: a key of its own
    scaled = ReplayedCall(lambda t: t * factor["value"], lambda t: [t, factor["value"]])
    assert [torch.equal(scaled(x), x * 2.0) for _ in range(3)] == [True] * 3 and scaled.replays == 2
    factor["value"] = 3.0
    assert torch.equal(scaled(x), x * 3.0) and scaled.replays == 2  # run as it is, not the recording

    synced = ReplayedCall(lambda t: t * t.sum().item(), lambda t: [t])
    synced(x)
    with pytest.warns(RuntimeWarning, match="could not be recorded"):
        out = synced(x)
    assert synced.error is not None and not synced.graphs
    assert torch.equal(out, x * x.sum().item()) and torch.equal(synced(x), x * x.sum().item())


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["launched", "cuda-graphs"])
@pytest.mark.parametrize("quant", [MIXED, STOCHASTIC], ids=["mixed", "stochastic"])
def test_the_compiled_step_on_cuda_is_bit_identical_to_eager(make_config, tmp_path, monkeypatch, quant,
                                                             cuda_graphs):
    """The step graph on the GPU (Triton kernels, every other op its ATen kernel, a Python wrapper),
    its kernels launched one by one or replayed as CUDA graphs, bf16 autocast on, against the eager
    model on the GPU: 8 steps (CUDA graphs: a warm-up, a recording, six replays; the eager model
    evaluates at 1, 4 and 8), diagnostics every step, their calls after the backward and the update
    replayed too with CUDA graphs (every metric and every bit positions row compared); with
    stochastic rounding both draw from the same CUDA generator state."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    eager, compiled = eager_and_compiled(make_config, tmp_path, *TINY, *quant, "train.max_steps=100",
                                         "train.device=cuda", "train.autocast=true",
                                         f"train.cuda_graphs={cuda_graphs}")
    skips = cudagraph_skips()
    for step in range(1, 9):
        assert_step_identical(eager, compiled, step)
    launches = graph_launches(lambda: assert_step_identical(eager, compiled, 9))
    assert compiled.forward.graphs == 1 and compile_status() == "compiled"
    assert (launches >= 2 + len(REPLAYED)) if cuda_graphs else (launches == 0), launches
    assert cudagraph_skips() == skips
    assert all(n >= 5 if cuda_graphs else n == 0 for n in replayed(compiled).values()), replayed(compiled)
    assert read_jsonl(tmp_path / "eager" / BIT_POSITIONS_FILE) == read_jsonl(tmp_path / "compiled" / BIT_POSITIONS_FILE)


def test_cuda_graphs_follow_the_step_graphs_of_a_run(make_config, tmp_path, monkeypatch):
    """A run switches step graphs: diagnostics every other step and at step 1 (two graphs, each
    warmed up at its first call, recorded at its second and replayed in turn after), then an
    emergency format shift, after which both compile and record anew; the diagnostics' calls record
    anew with them. Against the eager model on the GPU, bit for bit over 18 steps (every metric,
    every bit positions row), every graph replayed, none skipped. (Added after the third lease: it
    first ran at the fourth.)"""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    eager, compiled = eager_and_compiled(make_config, tmp_path, *TINY, *MIXED, "train.diag_every=2",
                                         "train.max_steps=100", "train.device=cuda", "train.autocast=true",
                                         "train.cuda_graphs=true")
    skips = cudagraph_skips()
    # Diagnostic steps 1, 2, 4, 6, ...: that graph records at 2 and replays from 4; the other warms up
    # at 3, records at 5 and replays at 7. Shifted before 9: warm-ups at 9 and 10, recordings at 11
    # and 12, replays from 13. The diagnostics' calls record at their graph's first replay, or at the
    # next diagnostic step where that replay's tensors sit elsewhere than the recording's.
    for step in range(1, 19):
        if step == 9:
            for trainer in (eager, compiled):
                assert shift_layers(trainer.layers, [next(iter(trainer.layers))], "test")
        assert_step_identical(eager, compiled, step)
    assert read_jsonl(tmp_path / "eager" / BIT_POSITIONS_FILE) == read_jsonl(tmp_path / "compiled" / BIT_POSITIONS_FILE)
    assert compiled.forward.graphs == 4 and compile_status() == "compiled"  # (with, without diagnostics) x 2 formats
    before = replayed(compiled)
    without, with_diagnostics = (graph_launches(partial(compiled.train_step, step)) for step in (19, 20))
    assert without >= 2 and with_diagnostics >= 2 + len(REPLAYED), (without, with_diagnostics)
    assert cudagraph_skips() == skips
    after = replayed(compiled)  # the shifted diagnostics' recordings replay at step 20
    assert all(after[name] == before[name] + 1 for name in REPLAYED), (before, after)
    assert len(compiled.diagnostics.after_update.graphs) == 2  # one per format of the shifted layer


def test_a_run_with_cuda_graphs_resumes_exactly(make_config, tmp_path, monkeypatch):
    """Killed after step 8 and resumed from step 5's checkpoint, a run whose step replays CUDA
    graphs ends where an uninterrupted eager one does on the GPU, bit for bit: a checkpoint is
    parameters, buffers and optimizer state, none of them in the graphs' memory pool, and the
    resumed trainer (a new one, as in a restarted process) records graphs of its own."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    skips = cudagraph_skips()
    resumed, _ = assert_exact_resume(make_config, tmp_path, *TINY, *MIXED, "train.device=cuda",
                                        "train.autocast=true", "train.cuda_graphs=true")
    assert resumed.forward.graphs == 1 and compile_status() == "compiled"
    assert graph_launches(lambda: resumed.train_step(13)) >= 2
    assert cudagraph_skips() == skips


def test_no_compiled_graph_replays_cuda_graphs_unless_asked(make_config, tmp_path, monkeypatch):
    """TORCHINDUCTOR_CUDAGRAPHS=1 (inductor's `triton.cudagraphs`, on for every graph) must not reach
    a kernel, whose replayed output the next call would overwrite, nor a step graph whose run
    turned CUDA graphs off (`train.cuda_graphs: false`): with it, a kernel compiled now and such a
    trainer's steps launch no CUDA graph."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        double = Kernel(lambda x: x * 2)  # a new function: compiled here, under the patch
        x = torch.arange(1024.0, device=CUDA)
        trainer = Trainer(make_config(*TINY, "quant.format=e4m3", "train.device=cuda", "train.compile=true",
                                      "train.cuda_graphs=false", "train.max_steps=100"), tmp_path)
        outputs = [double(x) for _ in range(2)]
        for step in (2, 3):
            trainer.train_step(step)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            outputs.append(double(x))
            trainer.train_step(4)
            torch.cuda.synchronize()
    assert not any(e.name == "cudaGraphLaunch" for e in prof.events())
    assert all(torch.equal(out, x * 2) for out in outputs) and compile_status() == "compiled"


def differing(a: torch.Tensor, b: torch.Tensor) -> list[tuple[float, float]]:
    """The first few (got, want) pairs that differ, for the failure message."""
    bad = (a != b) & ~(a.isnan() & b.isnan()) if a.is_floating_point() else a != b
    return list(zip(a[bad][:5].tolist(), b[bad][:5].tolist(), strict=True))


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("scale", [None, 0.37], ids=["unscaled", "scaled"])
def test_cuda_kernels_are_bit_identical_to_cpu(name, scale, monkeypatch):
    """FMA contraction or fast math in the Triton kernel would break the Veltkamp split and the
    magic-number rounding on some inputs; every code, midpoint and special is probed."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    f = FORMATS[name]
    x = torch.cat([edge_values(f), random_values(f, 1 << 18)])
    step = random_values(f, x.numel(), seed=1) * 2.0 ** -(f.mbits + 2)
    x_new = x + step

    def run(device: torch.device) -> dict[str, torch.Tensor]:
        a, b = x.to(device), x_new.to(device)
        q = quantize(a, f, scale)
        moves = code_moves(a, b, f, scale)
        stats = TensorStats().to(device)
        stats.observe(a, q, f, torch.tensor(1.0 if scale is None else scale, device=device))
        return {"quantize": q, "quantize_bf16": quantize(a.bfloat16(), f, scale),
                "encode": encode(a, f, scale), "counted": stats.counted, **moves}

    want = cpu_reference(monkeypatch, lambda: run(torch.device("cpu")))
    got = {k: v.cpu() for k, v in run(CUDA).items()}
    assert compile_status() == "compiled"
    for key, expected in want.items():
        same = same_values(got[key], expected) if expected.is_floating_point() else torch.equal(
            got[key], expected)
        assert same, (key, differing(got[key], expected))


@pytest.mark.parametrize("mode", ["delayed", "dynamic"])
def test_cuda_scaler_steps_match_cpu(mode, monkeypatch):
    """The compiled scaler step (amax, history roll, power-of-two scale) against eager on CPU, over
    tensors that keep, grow, zero and poison the amax."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4096, generator=g) * 3, torch.randn(4096, generator=g) * 1e3, torch.zeros(4096),
          torch.full((4096,), math.nan), torch.randn(4096, generator=g) * 1e-20,
          torch.randn(4096, generator=g).bfloat16()]

    def run(device: torch.device) -> list[torch.Tensor]:
        scaler = TensorScaler("e4m3", ScalingPolicy(mode, history_len=4, margin=1)).to(device)
        return [torch.cat([scaler.update(x.to(device)).reshape(1), scaler.amax.reshape(1),
                           scaler.amax_history]).cpu() for x in xs]

    want = cpu_reference(monkeypatch, lambda: run(torch.device("cpu")))
    for got, expected in zip(run(CUDA), want, strict=True):
        assert same_values(got, expected), (got, expected)


@pytest.mark.parametrize("name", ["e4m3", "e2m5", "e7m0"])
def test_cuda_stochastic_rounding_lands_on_a_neighbour_code(name):
    """The GPU's random stream differs from the CPU's, so check the property, not the values:
    each result is one of the two codes around x, and the mean is unbiased."""
    f = FORMATS[name]
    x = random_values(f, 1 << 16).clamp(-f.max, f.max).to(CUDA)
    down = quantize(x, f, rounding="nearest")
    q = quantize(x, f, rounding="stochastic", generator=torch.Generator(CUDA).manual_seed(0))
    codes, near = encode(q, f).long(), encode(down, f).long()
    assert (ordinal(codes) - ordinal(near)).abs().max() <= 1
    lo, hi = decode(torch.tensor([0x30, 0x31], dtype=torch.uint8), f).tolist()
    quarter = torch.full((1 << 20,), lo + (hi - lo) / 4, device=CUDA)
    sr = quantize(quarter, f, rounding="stochastic", generator=torch.Generator(CUDA).manual_seed(1))
    assert set(sr.unique().tolist()) == {lo, hi}
    assert sr.double().mean().item() == pytest.approx(quarter[0].item(), rel=(hi - lo) / hi / 100)


@pytest.mark.parametrize("fmt", ["e4m3", "e7m0"])
def test_trainer_runs_on_cuda_with_bf16_autocast(make_config, tmp_path, fmt):
    cfg = make_config(f"quant.format={fmt}", "train.device=cuda", "train.autocast=true",
                      "train.max_steps=12", "train.eval_interval=6", "train.shadow_every=3",
                      "train.diag_every=1", "model.n_embd=128", "model.n_head=4")
    summary = Trainer(cfg, tmp_path).fit()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 12 or summary["stop_reason"] != "completed"
    if fmt == "e4m3":
        assert summary["stop_reason"] == "completed"
        assert rows[-1]["val/loss"] < rows[0]["val/loss"] - 0.5
        assert all(math.isfinite(v) for r in rows for k, v in r.items() if isinstance(v, float)
                   and not k.startswith("stability/"))
