"""benchmarks/record.py: results files round-trip, the README table is rendered from the committed
ones (never typed by hand), and a benchmark's `--record` writes the ratios it printed."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from altgrad.quant import FORMATS

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def load(name: str):
    """A benchmark script as a module, importable as its script imports it (`from record import`)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


record = load("record")


def test_results_round_trip_and_render(tmp_path):
    claims = [record.Claim("e4m3", 1.23456, "bf16", 1.25, "12.3 vs 10.0 ms"),
              record.Claim("e4m3+diag", 1.3, "e4m3", 1.25)]
    path = record.write("train_step-cpu", claims, tmp_path)
    assert path == tmp_path / "train_step-cpu.json"
    (result,) = record.read_all(tmp_path)
    assert result.claims == tuple(claims) and result.name == "train_step-cpu"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", result.date) and result.commit and result.machine
    rows = record.table([result]).splitlines()[2:]
    assert len(rows) == 2
    assert "| e4m3 vs bf16 | 1.23x (12.3 vs 10.0 ms) | <= 1.25x: met |" in rows[0]
    assert "| e4m3+diag vs e4m3 | 1.30x | <= 1.25x: **missed** |" in rows[1]
    assert result.commit in rows[0] and result.commit not in rows[1]  # the run is named once


def test_publish_replaces_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# T\nbefore\n{record.BEGIN}\nold | row\n{record.END}\nafter\n")
    record.write("quantize", [record.Claim("compiled e4m3 quantizer", 0.4, "native", 0.5)], tmp_path / "r")
    assert record.main(["--readme", str(readme), "--results", str(tmp_path / "r")]) == 0
    text = readme.read_text()
    assert text.startswith("# T\nbefore\n") and text.endswith(f"{record.END}\nafter\n")
    assert "old | row" not in text and "| 0.40x | <= 0.5x: met |" in text
    assert record.main(["--readme", str(readme), "--results", str(tmp_path / "empty")]) == 2


def test_readme_table_is_the_committed_results():
    """Edit a number in the README by hand, or commit a result without `make bench`'s publish
    step, and this fails."""
    results = record.read_all()
    assert {r.name for r in results} >= {"quantize", "train_step-cpu", "optimizer_step-cpu", "sweep_overhead"}
    text = (ROOT / "README.md").read_text()
    block = text.split(record.BEGIN, 1)[1].split(record.END, 1)[0].strip()
    assert block == record.table(results)


def test_quantize_benchmark_records_what_it_printed(tmp_path, capsys):
    bench = load("quantize")
    assert bench.main(["--smoke", "--record", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{name} " in out for name in FORMATS) and "quantizer: compiled" in out
    saved = json.loads((tmp_path / "quantize.json").read_text())
    printed = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1]
               and line.split()[0] in ("e4m3", "e5m2")}
    by_what = {c["what"]: c for c in saved["claims"]}
    for family in ("e4m3", "e5m2"):
        claim = by_what[f"compiled {family} quantizer"]
        assert claim["ratio"] == pytest.approx(float(printed[family][4].rstrip("x")), abs=0.006)
        assert claim["target"] == bench.NATIVE_TARGET
    slowest = next(c for c in saved["claims"] if c["what"].startswith("slowest"))
    assert slowest["baseline"] == "compiled e4m3" and slowest["target"] == bench.EXOTIC_TARGET


@pytest.mark.usefixtures("eager_kernels")  # the compiled kernels are tested elsewhere
def test_train_step_host_preset_records_its_ratios(tmp_path, capsys):
    """The host-bound proxy builds the 6-layer, 16-wide, batch-1 model and records each ratio
    with the milliseconds it came from."""
    bench = load("train_step")
    preset, bundle = bench.BENCH_PRESETS["host"]
    assert preset == "cpu" and {"model.n_layer=6", "model.n_embd=16", "train.batch_size=1"} <= set(bundle)
    bench.main(["--preset", "host", "--smoke", "--record", str(tmp_path)])
    capsys.readouterr()
    saved = json.loads((tmp_path / "train_step-host.json").read_text())
    assert {(c["what"], c["baseline"], c["target"]) for c in saved["claims"]} == {
        tuple(target) for target in bench.TARGETS["host"]}
    for claim in saved["claims"]:
        a, b = (float(x) for x in re.findall(r"([\d.]+) (?:vs|ms)", claim["detail"])[:2])
        assert (a - 0.05) / (b + 0.05) <= claim["ratio"] <= (a + 0.05) / (b - 0.05)  # printed to 0.1 ms


@pytest.mark.usefixtures("eager_kernels")
def test_train_step_runs_the_chosen_variants_and_their_targets_only(capsys):
    """`--variants e4m3` builds bf16 (the baseline) and e4m3 alone and checks the one target
    between them; an unknown name, or a record of a subset, is a usage error."""
    bench = load("train_step")
    bench.main(["--preset", "cpu", "--smoke", "--variants", "e4m3"])
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[1:] if line.endswith("s") and "/" not in line]
    assert rows == ["bf16", "e4m3"]
    assert [line.split(":")[0] for line in out.splitlines() if " / " in line] == ["e4m3 / bf16"]
    for argv in (["--variants", "e4m3,e9m9"], ["--variants", "e4m3", "--record", "somewhere"]):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--preset", "cpu", "--smoke", *argv])
        assert exit_.value.code == 2
    assert "unknown variant(s) e9m9" in capsys.readouterr().err


@pytest.mark.usefixtures("eager_kernels")
def test_train_step_repeated_in_fresh_processes_checks_the_median_ratio(tmp_path, capsys):
    """`--repeat 2` measures in two processes of their own, prints each one's steps, and records
    each target on the median of the two ratios, with both ratios, their milliseconds and in how
    many processes the target held; `--repeat 0` is a usage error."""
    bench = load("train_step")
    bench.main(["--preset", "host", "--smoke", "--repeat", "2", "--record", str(tmp_path)])
    out = capsys.readouterr().out
    pids = [int(p) for p in re.findall(r"^process \d of 2 \(pid (\d+)\):$", out, re.M)]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    saved = json.loads((tmp_path / "train_step-host.json").read_text())
    assert {(c["what"], c["baseline"], c["target"]) for c in saved["claims"]} == {
        tuple(target) for target in bench.TARGETS["host"]}
    for claim in saved["claims"]:
        each = re.findall(r"([\d.]+)x \(([\d.]+) vs ([\d.]+) ms\)", claim["detail"])
        assert len(each) == 2
        ratios = [float(r) for r, _, _ in each]
        for r, a, b in each:  # each process's ratio is that process's milliseconds, printed rounded
            assert (float(a) - 0.05) / (float(b) + 0.05) - 0.005 <= float(r) <= (float(a) + 0.05) / (float(b) - 0.05) + 0.005
        assert abs(claim["ratio"] - sum(ratios) / 2) <= 0.005 + 1e-9  # the median of two
        held = int(re.fullmatch(r".*; held in (\d) of 2", claim["detail"]).group(1))
        surely = sum(r < claim["target"] - 0.005 for r in ratios)  # (printed to 0.01)
        assert surely <= held <= sum(r <= claim["target"] + 0.005 for r in ratios)
        line = next(row for row in out.splitlines() if row.startswith(f"{claim['what']} / {claim['baseline']}:"))
        assert f"median {claim['ratio']:.2f}x of {' '.join(f'{r:.2f}x' for r in ratios)}" in line
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--preset", "host", "--smoke", "--repeat", "0"])
    assert exit_.value.code == 2


def test_a_repeated_target_is_the_median_process_and_says_where_it_held():
    """Three processes whose e4m3 took 1.2x, 1.4x and 1.25x their bf16: the claim is 1.25x (the
    median, not the first or the mean), held in 2 of 3 against 1.3x; one process is its own."""
    bench = load("train_step")
    runs = [bench.Measurement({"bf16": 0.010, "e4m3": 0.010 * r}, {}, 40) for r in (1.2, 1.4, 1.25)]
    claim = bench.target_claim(runs, "e4m3", "bf16", 1.3)
    assert claim.ratio == pytest.approx(1.25) and claim.met
    assert claim.detail == ("median of 3 processes, each the median of 40 steps: 1.20x (12.0 vs 10.0 ms), "
                            "1.40x (14.0 vs 10.0 ms), 1.25x (12.5 vs 10.0 ms); held in 2 of 3")
    assert not bench.target_claim(runs, "e4m3", "bf16", 1.22).met  # the median misses, one process held
    one = bench.target_claim(runs[1:2], "e4m3", "bf16", 1.3)
    assert (one.ratio, one.met, one.detail) == (pytest.approx(1.4), False, "14.0 vs 10.0 ms, median of 40 steps")


@pytest.mark.usefixtures("eager_kernels")
def test_step_profile_profiles_the_host_proxy(monkeypatch, capsys):
    """`step_profile.py --preset host` profiles train_step's host-bound proxy, with --set on top
    (it was a ConfigError traceback: 'host' is a bundle, not a RunConfig preset), and with
    --callers lists the functions that made each variant's native calls."""
    bench = load("step_profile")
    built = []

    def build(overrides, total_steps, workdir):
        built.append(trainer := load("train_step").build(overrides, total_steps, workdir))
        return trainer

    monkeypatch.setattr(bench, "build", build)
    bench.main(["--preset", "host", "--set", "optim.lr=0.01", "--variants", "bf16,e4m3", "--smoke", "--rows", "3",
                "--callers", "50"])
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("== ")] == ["== bf16", "== e4m3"]
    assert len(re.findall(r"^CPU [\d.]+ ms$", out, flags=re.M)) == 2
    bf16, e4m3 = (part.split("called from\n")[1] for part in out.split("== ")[1:])
    assert "(trainer.py:" in bf16 and "(trainer.py:" in e4m3  # --callers: the step's native work, by function
    assert "round_nearest (kernels.py:" in e4m3 and "round_nearest (" not in bf16  # the quantizers, where they run
    for trainer, fmt in zip(built, ("bf16", "e4m3"), strict=True):
        cfg = trainer.cfg
        assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.block_size, cfg.train.batch_size) == (6, 16, 8, 1)
        assert cfg.train.compile and cfg.optim.lr == 0.01 and cfg.quant.format == fmt


@pytest.mark.parametrize("torch_events", ["current", "2.11"])
def test_op_callers_counts_each_native_call_once_under_the_altgrad_function_that_made_it(eager_kernels, torch_events):
    """Two ops called from here (no altgrad frame), and a quantize, whose ATen ops nest (an op
    inside another counts once) under altgrad's functions, and a module's call (the tracer's
    `nn.Module:` event). Also with the events as torch 2.11, the GPU machines', gives them: without
    `is_python_function`, which left its lease's table with every call under "(no altgrad frame)"
    (this torch's events with that attribute deleted: the names are the tracer's on both)."""
    from torch.profiler import ProfilerActivity, profile

    from altgrad.quant import FORMATS, quantize

    bench = load("step_profile")
    x, linear = torch.randn(64), torch.nn.Linear(64, 2)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        y = x * 2
        torch.zeros(3)
        quantize(y, FORMATS["e4m3"])
        linear(x)
    if not hasattr(prof.events()[0], "is_python_function"):  # (torch 2.11: the "2.11" case stands for it)
        pytest.skip("this torch's events have no is_python_function, the oracle")
    python_calls = {id(e) for e in prof.events() if e.is_python_function}
    assert {"<built-in", "nn.Module: Linear"} <= {e.name[:len(kind)] for e in prof.events() if id(e) in python_calls
                                                 for kind in ("<built-in", "nn.Module: Linear")}
    if torch_events == "2.11":
        for event in prof.events():
            del event.is_python_function
    assert {id(e) for e in prof.events() if bench.is_python_call(e)} == python_calls
    rows = bench.op_callers(prof.events())
    assert rows["(no altgrad frame)"].calls == 3  # x * 2, zeros, and the linear's one ATen call
    quantizer = {site: row for site, row in rows.items() if site != "(no altgrad frame)"}
    assert quantizer and all(".py:" in site and "(" in site for site in quantizer)
    assert any(site.startswith("quantize (") or "< quantize (" in site for site in quantizer)
    top_level = [e for e in prof.events() if e.name.startswith("aten::") and not e.cpu_parent.name.startswith("aten::")]
    assert sum(row.calls for row in rows.values()) == len(top_level)
    assert all(row.kernels == row.graphs == 0 and row.host_us > 0 for row in rows.values())
    table = bench.caller_table(rows, 1, cuda=False).splitlines()
    assert len(table) == 2 and table[1].split()[0] == str(max(rows.values(), key=lambda r: r.host_us).calls)


@pytest.mark.usefixtures("eager_kernels")
def test_step_profile_times_each_phase_a_variant_runs(capsys):
    """`--phases` prints train_step phase by phase, in the order the step runs them: the
    diagnostics' calls, bit tracking and its file only in the variant that runs them."""
    bench = load("step_profile")
    bench.main(["--preset", "host", "--variants", "e4m3,e4m3+diag", "--phases", "3", "--smoke"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-2:] == ["e4m3", "e4m3+diag"]
    table = {line[:30].strip(): line[30:].split() for line in lines[2:]}
    diagnostic = [f"diagnostics.{call}" for call in bench.DIAGNOSTICS_CALLS] + ["bit tracking", "bit positions file"]
    assert list(table) == ["diagnostics.begin", "forward", "backward", "diagnostics.after_backward",
                           "diagnostics.activation_metrics", "diagnostics.gradient_metrics", "diagnostics.snapshot",
                           "optimizer step", "diagnostics.after_update", "diagnostics.update_metrics",
                           "diagnostics.quant_metrics", "diagnostics.end", "bit tracking", "bit positions file",
                           "other", "step"]
    for phase in diagnostic:
        assert table[phase][0] == "-" and float(table[phase][1]) > 0, phase
    for phase in ("forward", "backward", "optimizer step"):
        assert all(float(cell) > 0 for cell in table[phase]), phase


def test_a_phase_counts_its_own_time_alone():
    """A timed call inside another (the shadow's backward inside the shadow) is taken out of the
    outer phase: no moment counts twice. Sleeps of 40 and 60 ms; a call wrapped twice counts once."""
    times = load("step_profile").ExclusiveTimes()
    inner = times.timed(lambda: time.sleep(0.06), "backward")

    def outer():
        time.sleep(0.04)
        inner()

    times.timed(outer, "shadow")()
    times.timed(inner, "backward")()  # a timed call wrapped twice: its time is still counted once
    # lower bounds exact (a sleep never ends early); upper ones below what double counting gives
    assert 0.04 <= times.seconds["shadow"] < 0.1
    assert 0.12 <= times.seconds["backward"] < 0.18


@pytest.mark.usefixtures("eager_kernels")
def test_step_profile_phases_of_a_step_with_the_shadow(tmp_path):
    """A step with every diagnostic and the shadow: every phase it runs is timed, none longer than
    the step, the untimed rest not negative; the backward wrapper is taken off after each step."""
    bench = load("step_profile")
    overrides = ["preset=cpu", *load("train_step").BENCH_PRESETS["host"][1], "quant.format=e4m3",
                 "train.diag_every=1", "train.shadow_every=1"]
    clock = bench.PhaseClock(bench.build(overrides, 10, tmp_path / "run"))
    backward = torch.autograd.backward
    for step in range(2, 5):
        clock.step(step)
    assert torch.autograd.backward is backward
    assert len(clock.steps) == 3
    for phases in clock.steps:
        assert set(phases) == {*bench.PHASES, bench.OTHER, bench.STEP}
        assert phases[bench.OTHER] >= 0
        assert all(0 < t <= phases[bench.STEP] for phase, t in phases.items() if phase != bench.OTHER)


@pytest.mark.parametrize(("script", "argv", "says"), [
    ("train_step", ["--preset", "tpu"], "invalid choice: 'tpu'"),
    ("train_step", ["--set", "model.n_layers=2"], "model.n_layers: unknown field"),
    ("step_profile", ["--preset", "host2"], "invalid choice: 'host2'"),
    ("step_profile", ["--preset", "host", "--set", "train.batch_size=0"], "train.batch_size"),
    ("step_profile", ["--phases", "0"], "--phases needs at least one step"),
    ("gpu_sharing", ["--set", "model.n_layer=abc"], "model.n_layer"),
    ("optimizer_step", ["--format", "e9m9"], "invalid choice: 'e9m9'"),
    ("sweep_overhead", ["--set", "grid.formats=[e9m9]"], "unknown format 'e9m9'"),
])
def test_a_benchmark_rejects_a_bad_option_before_it_starts(script, argv, says, capsys):
    """A mistyped preset, format or --set is a usage error (exit 2, the field named), not a
    traceback out of a trainer or a child process minutes later."""
    with pytest.raises(SystemExit) as exit_:
        load(script).main([*argv, "--smoke"])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_a_profiled_steps_device_time_counts_each_kernel_once():
    """A replayed CUDA graph's kernels are the device's events, and the host op that launched the
    graph carries their time as its own device time too (H200 profile of a diagnostic step: 18.6 ms
    printed where the device ran 9.8): the device time is the device's events alone. Launches are
    told apart: kernels launched one by one, graphs."""
    from torch.autograd.profiler_util import FunctionEvent, FunctionEventAvg
    from torch.profiler import DeviceType

    def event(i: int, name: str, start: int, end: int, device: DeviceType = DeviceType.CPU) -> FunctionEvent:
        return FunctionEvent(i, name, thread=0, start_us=start, end_us=end, use_device="cuda", device_type=device)

    graph_call, mm = event(0, "## Call CompiledFxGraph", 0, 50), event(1, "aten::mm", 60, 70)
    graph_launch, kernel_launch = event(2, "cudaGraphLaunch", 5, 45), event(3, "cudaLaunchKernel", 61, 69)
    device = [event(4, "triton_poi_fused_0", 10, 310, DeviceType.CUDA),
              event(5, "triton_red_fused_1", 310, 410, DeviceType.CUDA),
              event(6, "gemm", 420, 620, DeviceType.CUDA)]
    for kernel in device[:2]:
        graph_call.append_kernel(kernel.name, 0, kernel.time_range.elapsed_us())
    mm.append_kernel("gemm", 0, 200)
    ops = []
    for e in (graph_call, mm, graph_launch, kernel_launch, *device):  # as key_averages() groups a profile
        ops.append(FunctionEventAvg())
        ops[-1].add(e)
    summary = load("step_profile").profile_summary(ops, cuda=True)
    assert re.search(r"; device ([\d.]+) ms", summary).group(1) == "0.6"  # 300 + 100 + 200 us
    assert summary.endswith("1 kernel launches, 1 graph launches")
    assert re.fullmatch(r"CPU [\d.]+ ms", load("step_profile").profile_summary(ops, cuda=False))
