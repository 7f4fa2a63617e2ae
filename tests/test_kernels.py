"""The step graph (`kernels.StepGraph`, `train.compile`): a whole forward and backward in one
compiled graph, bit for bit what the eager model computes, with a bounded number of graphs, and
resuming exactly."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from compiled_steps import (
    MIXED,
    STOCHASTIC,
    TINY,
    assert_exact_resume,
    assert_step_identical,
    eager_and_compiled,
)
from host_reads import CPU_ONLY_READS, host_reads
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import profile

from altgrad.quant import compile_status, precompiled_headers
from altgrad.quant.kernels import (
    GRAPHS_PER_KERNEL,
    TRANSPOSES,
    Compiled,
    Kernel,
    StepGraph,
    as_permute,
    graph_device_type,
    rollback_point,
    step_graph_options,
)
from altgrad.quant.precompiled_headers import WRAPPER_HEADER, wrapper_includes
from altgrad.train import Trainer
from altgrad.train.format_shift import shift_layers

# One worker, in order: the resume test's step graph is the mixed test's, which it then takes from
# the compile caches instead of compiling it cold a second time on the other worker.
pytestmark = pytest.mark.xdist_group("step_graph")


@pytest.fixture(autouse=True)
def fresh_counters():
    """Dynamo's counters are process-wide: count this test's graphs and graph breaks only."""
    counters.clear()


# Ops the quantizers compute with and the rest of a step does not: called as ATen ops, a kernel ran
# op by op instead of lowered into the graph's fused loops.
QUANTIZER_OPS = ("aten::copysign", "aten::aminmax")


def profiled_step(trainer: Trainer, step: int) -> list:
    """The profiler's events of one training step of `trainer`, with their inputs' shapes."""
    with profile(record_shapes=True) as prof:
        trainer.train_step(step)
    return prof.events()


def aten_ops(events: list) -> set[str]:
    return {event.name for event in events}


def logits_sized_fills(events: list, trainer: Trainer) -> int:
    """Fills of a tensor the logits' shape (batch x block x vocab): what AOTAutograd makes as the
    gradient of a step graph output that no loss reaches (the cross-entropy's own gradient is
    the flattened (batch * block) x vocab)."""
    cfg = trainer.cfg
    logits = [cfg.train.batch_size, cfg.model.block_size, trainer.model.config.vocab_size]
    return sum(event.name in ("aten::fill_", "aten::zero_") and event.input_shapes[:1] == [logits]
               for event in events)


def graph_ops(events: list) -> set[str]:
    """The ops the compiled graphs' calls (forward and backward) make themselves, not those an op
    they call makes in turn."""
    def in_graph(event) -> bool:
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("## Call CompiledFxGraph"):
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return parent is not None

    return {event.name for event in events if in_graph(event)}


@pytest.mark.parametrize("quant", [MIXED, STOCHASTIC, ("quant.format=bf16",)], ids=["mixed", "stochastic", "bf16"])
def test_compiled_step_is_bit_identical_to_eager(make_config, tmp_path, monkeypatch, quant):
    """The reference is the eager model (`train.compile: false`) with its kernels as plain
    functions, the ops a reader checks against the formats' specs; compiled on their own, the
    kernels are bit-identical to those (test_quantize). In the step graph the kernels' ops are
    lowered, not called one by one. Then the recompile guard: 20 more steps, each with its own lr,
    compile nothing new, and an emergency format shift at most one more graph."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    eager, compiled = eager_and_compiled(make_config, tmp_path, *TINY, *quant, "train.max_steps=100")
    for step in range(1, 11):  # diagnostics every step, an evaluation (eager) at 1, 4 and 8
        assert_step_identical(eager, compiled, step, functions=True)
    assert compile_status() == "compiled"
    assert counters["graph_break"] == {}

    step_graphs, all_graphs = compiled.forward.graphs, counters["stats"]["unique_graphs"]
    assert step_graphs == 1  # training with diagnostics (evaluation runs the eager model)
    events = profiled_step(compiled, 11)
    assert not set(QUANTIZER_OPS) & aten_ops(events)
    assert logits_sized_fills(events, compiled) == 0  # the graph returns the loss alone
    assert set(host_reads(events)) <= CPU_ONLY_READS  # (SPEC §5: see tests/host_reads.py)
    lrs = {compiled.train_step(step).metrics["train/lr"] for step in range(12, 32)}
    assert len(lrs) == 20
    assert compiled.forward.graphs == step_graphs and counters["stats"]["unique_graphs"] == all_graphs
    if quant is MIXED:  # (one model is enough: each shift is a compile of its own)
        assert shift_layers(compiled.layers, [next(iter(compiled.layers))], "test")
        compiled.train_step(32)
        assert compiled.forward.graphs == step_graphs + 1  # a layer's format is part of the graph


def test_quantizer_ops_are_seen_when_a_step_runs_them_one_by_one(make_config, tmp_path, monkeypatch):
    """The check above can fail: a step whose kernels run their ops one by one shows them in the
    profile (here with compiling off; a step graph whose kernels inductor did not lower calls the
    same ATen ops from its C++ wrapper, which the profiler records too: docs/design.md)."""
    monkeypatch.setenv("ALTGRAD_NO_COMPILE", "1")
    (tmp_path / "run").mkdir()  # (train_step without fit writes bit positions there)
    trainer = Trainer(make_config(*TINY, *MIXED, "train.max_steps=100", "train.compile=true"), tmp_path / "run")
    assert set(QUANTIZER_OPS) <= aten_ops(profiled_step(trainer, 2))


def test_resume_with_the_compiled_step_is_bit_identical(make_config, tmp_path, monkeypatch):
    """Killed after step 8 and resumed from step 5's checkpoint, a compiled run ends where an
    uninterrupted eager one does, bit for bit -- its step graph taken from AOTAutograd's cache, as
    a later trial of a sweep takes it (the killed run compiled the same graph)."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    resumed, cache_hits = assert_exact_resume(make_config, tmp_path, *TINY, *MIXED, functions=True)
    assert resumed.forward.graphs > 0 and cache_hits > 0
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["compile"] == "compiled (step graph)"


def test_the_step_graph_has_a_cpp_wrapper_on_the_cpu_only():
    """The wrapper follows the device the graph's inputs are on: C++ on the CPU; on CUDA inductor's
    C++ wrapper did not build (docs/design.md, "GPU runs"), so Python there, where
    tests/test_cuda.py checks that the step compiles. A CPU scalar input beside the accelerator's
    tensors must not make a graph a CPU one."""
    cpu = [torch.zeros(4, 4), torch.tensor(1.0)]
    accelerator = [torch.zeros(4, 4, device="meta"), torch.tensor(1.0)]
    assert graph_device_type(cpu) == "cpu" and graph_device_type(accelerator) == "meta"
    on_cpu, elsewhere = step_graph_options("cpu"), step_graph_options("meta")
    assert on_cpu["cpp_wrapper"] and not elsewhere["cpp_wrapper"]

    def lowering(options: dict) -> dict:
        return {k: v for k, v in options.items() if not k.startswith("cpp_wrapper")}

    assert lowering(on_cpu) == lowering(elsewhere)  # the same kernels, bit for bit, either wrapper
    # CUDA graphs where a run asks for them and the graph is on CUDA (tests/test_cuda.py replays them)
    replayed = step_graph_options("cuda", cuda_graphs=True)
    assert replayed["triton.cudagraphs"] and lowering(replayed) == {**lowering(elsewhere), "triton.cudagraphs": True}
    # ... and nowhere else: the trainer passes train.cuda_graphs whatever its device
    assert not any(step_graph_options(device, cuda_graphs=asked)["triton.cudagraphs"]
                   for device, asked in (("cpu", True), ("meta", True), ("cuda", False)))


def test_a_step_graph_says_where_it_replays(monkeypatch):
    """`StepGraph.replays_on`, which decides whether the trainer's diagnostics replay too: on CUDA
    where the run asks for CUDA graphs, as its options record them, and not with compiling off."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    asked, not_asked = StepGraph(torch.nn.Identity(), cuda_graphs=True), StepGraph(torch.nn.Identity())
    assert asked.replays_on(cuda) and not asked.replays_on(cpu) and not not_asked.replays_on(cuda)
    for graph, device in ((asked, cuda), (asked, cpu), (not_asked, cuda)):
        assert graph.replays_on(device) == step_graph_options(device.type, graph.cuda_graphs)["triton.cudagraphs"]
    monkeypatch.setenv("ALTGRAD_NO_COMPILE", "1")  # everything eager: nothing is recorded
    assert not asked.replays_on(cuda)


def leading_includes(source: str) -> list[str]:
    """The headers a generated C++ source includes at its top, before its first declaration: a
    wrapper's own headers (the Python binding's glue, appended after the code, includes more)."""
    top = []
    for line in source.splitlines():
        if line.strip() and not line.lstrip().startswith("#include"):
            break
        top.append(line)
    return wrapper_includes("\n".join(top))


class WrapperCalls(NamedTuple):
    precompiled: dict[str, set[str]]  # each header inductor was asked to precompile: the files it got
    wrappers: list[str]  # each C++ wrapper's source inductor loaded ...
    kernels: list[str | None]  # ... and the source of its fused loops, compiled apart from it (none: empty)


@pytest.fixture
def wrapper_calls(monkeypatch) -> WrapperCalls:
    """What inductor is asked, while a test runs, to precompile and to load as a C++ wrapper; with
    compiling allowed, and altgrad's hooks into inductor's headers in place (as any compile of
    altgrad's has them) before these recordings wrap them."""
    from torch._inductor import codecache

    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    precompiled_headers.install()
    calls = WrapperCalls({}, [], [])
    precompile, load = codecache._precompile_header, codecache.CppWrapperCodeCache.load_pybinding.__func__

    def recorded_precompile(header: str, *args, **kwargs) -> str:
        path = precompile(header, *args, **kwargs)
        calls.precompiled.setdefault(header, set()).add(path)
        return path

    def recorded_load(cls, *args, **kwargs):
        calls.wrappers.append(kwargs["main_code"])
        calls.kernels.append(kwargs.get("kernel_code"))
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(codecache, "_precompile_header", recorded_precompile)
    monkeypatch.setattr(codecache.CppWrapperCodeCache, "load_pybinding", classmethod(recorded_load))
    return calls


def test_a_cpu_wrapper_is_built_against_one_precompiled_header_of_all_it_includes(wrapper_calls):
    """A step graph whose wrapper calls ATen ops through the boxed dispatcher (layer norm, GELU,
    arange) includes the dispatcher's and the JIT types' headers. Inductor is asked to precompile
    `step_graph_wrapper.h`, not its own header, and that holds every header the wrapper includes,
    so g++ parses none of them per graph. Inductor's caches off: a cached graph compiles nothing."""
    precompiled, wrappers, _ = wrapper_calls

    def fn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (16,), weight)) * torch.arange(16)

    x, weight = torch.randn(4, 16), torch.randn(16, requires_grad=True)
    graph = StepGraph(fn)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        graph(x, weight).sum().backward()
    assert graph.error is None and len(wrappers) == 2  # the forward's and the backward's
    assert str(WRAPPER_HEADER) in precompiled
    held = wrapper_includes(WRAPPER_HEADER.read_text())
    assert held[0] not in precompiled  # (inductor's own: the first it holds)
    for source in wrappers:
        included = leading_includes(source)
        assert set(included) <= set(held), set(included) - set(held)
    expected, weight.grad = weight.grad, None
    fn(x, weight).sum().backward()
    assert torch.equal(weight.grad, expected)
    if not all("ATen/core/dispatch/Dispatcher.h" in leading_includes(source) for source in wrappers):
        # (what this test is about; torch 2.11 calls these ops another way)
        pytest.skip("this torch's wrappers call no op through the boxed dispatcher")


def test_a_step_graph_from_the_cache_loads_its_wrapper_without_precompiling_a_header(wrapper_calls, monkeypatch,
                                                                                  tmp_path):
    """Inductor precompiles a wrapper's header at every load, a cached wrapper's too, where
    nothing is compiled (a warm trial on a new node paid the build for nothing). A step graph that
    AOTAutograd's cache holds loads its wrappers with no header precompiled; the same graph
    compiled cold got the wrapper header. (The process's in-memory caches are cleared between the
    two, as a new trial process starts without them.)"""
    from torch._inductor.utils import clear_caches

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    precompiled, loaded, _ = wrapper_calls

    def fn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (8,), weight).tanh()

    x, weight = torch.randn(4, 8), torch.randn(8, requires_grad=True)
    StepGraph(fn)(x, weight).sum().backward()
    assert str(WRAPPER_HEADER) in precompiled and len(loaded) == 2  # compiled cold: both wrappers
    torch._dynamo.reset()
    clear_caches()
    precompiled.clear(), loaded.clear()
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    graph = StepGraph(fn)
    graph(x, weight).sum().backward()
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1 and graph.error is None
    assert len(loaded) == 2  # loaded again, from the cache ...
    assert precompiled == {}  # ... with no header precompiled for them


def test_each_header_is_precompiled_once_for_files_compiled_alone_and_linked_at_once(wrapper_calls):
    """Inductor keys a precompiled header on the command line of the file that includes it. That
    differs between a file compiled alone (`-c`: a wrapper whose graph has fused loops, and those
    loops) and one compiled and linked at once (a wrapper of ATen calls alone, a kernel compiled
    by itself), while the header is built by one command either way: each header is built once,
    into one file, for both. Inductor's caches off: a cached graph compiles nothing."""
    precompiled, wrappers, kernels = wrapper_calls
    scaled = Kernel(lambda x, s: (x * s).round() / s)  # (a fused loop, unlike any other test's)

    def aten_only(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (16,), weight).tanh()

    def fused(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return scaled(aten_only(x, weight), 7.0)

    x, weight = torch.randn(4, 16), torch.randn(16, requires_grad=True)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        for fn in (aten_only, fused):
            graph = StepGraph(fn)
            graph(x, weight).sum().backward()
            assert graph.error is None
        scaled(x, 7.0)  # the kernel compiled by itself
    assert scaled.error is None and scaled.compiled is not None
    # both kinds of wrapper, so both kinds of command line include each header
    assert not all(kernels) and any(kernels), kernels
    assert {str(WRAPPER_HEADER), "torch/csrc/inductor/cpp_prefix.h"} <= set(precompiled)
    for header, files in precompiled.items():
        assert len(files) == 1, (header, files)
        assert Path(f"{next(iter(files))}.gch").is_file()


def test_a_header_is_keyed_on_its_build_and_on_inductors_key_where_this_torch_cannot_say_it(tmp_path, monkeypatch):
    """Directly, on a header of a line: two including command lines, one build command, one file.
    Where this torch's builder does not take the options (a TypeError), inductor's own key stands:
    a file per including command line, each still built."""
    from torch._inductor import codecache, cpp_builder

    precompiled_headers.install()
    header = tmp_path / "one_line.h"
    header.write_text("inline int one_line() { return 1; }\n")

    def files(*including: str) -> set[str]:
        return {codecache._precompile_header(str(header), command, device_type="cpu") for command in including}

    shared = files("g++ -c x.cpp", "g++ -shared x.cpp")
    assert len(shared) == 1 and Path(f"{next(iter(shared))}.gch").is_file()
    options = cpp_builder.CppTorchDeviceOptions

    def without_precompiling(*args, precompiling: bool = False, **kwargs):
        if precompiling:
            raise TypeError("unexpected keyword argument 'precompiling'")
        return options(*args, **kwargs)

    monkeypatch.setattr(cpp_builder, "CppTorchDeviceOptions", without_precompiling)
    own = files("g++ -c y.cpp", "g++ -shared y.cpp")
    assert len(own) == 2 and not own & shared and all(Path(f"{file}.gch").is_file() for file in own)


class AmaxHistory(torch.nn.Module):
    """A layer in miniature, none of its ops a kernel's: it writes its state (an amax history, as
    a scaler does) and multiplies through views and transposes of its weight and input."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 2))
        self.register_buffer("history", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.history.copy_(torch.cat([self.history[1:], x.detach().abs().amax().view(1)]))
        y = (x.view(2, 8) @ self.weight.view(8, 2)).select(0, 1) * self.history[-1]  # (backward: t)
        return y @ self.weight.transpose(0, 1)


# Ops that compute nothing (`kernels.computes_nothing`): lowered, a reinterpretation of a buffer
# or a write into the state's own buffer; not one of them an ATen call from the wrapper.
NOTHING_COMPUTED = ("aten::view", "aten::detach", "aten::select", "aten::slice", "aten::copy_", "aten::copy",
                    "aten::alias", "aten::t", "aten::transpose")


def test_the_step_graph_calls_no_op_that_computes_nothing(monkeypatch):
    """Views, aliases, transposes and the write of a step's state into its buffer are lowered, not
    left to lite mode's ATen fallback, which calls every unmarked op from the wrapper; the values, the
    gradient and the state written are eager's. Compiled with inductor's caches off: they do not
    key on the marks, so a cached graph would say nothing."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    torch.manual_seed(0)
    compiled, eager, x = AmaxHistory(), AmaxHistory(), torch.randn(16)
    eager.load_state_dict(compiled.state_dict())
    graph = StepGraph(compiled)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        graph(x).sum().backward()
    with profile() as prof:
        graph(2 * x).sum().backward()
    for y in (x, 2 * x):
        eager(y).sum().backward()
    called = graph_ops(prof.events())
    assert {"aten::mm", "aten::amax"} <= called  # lite mode: the arithmetic is ATen's, called from the wrapper
    assert not called & set(NOTHING_COMPUTED)
    assert graph.error is None and graph.graphs == 1
    assert torch.equal(compiled.history, eager.history) and torch.equal(compiled.weight.grad, eager.weight.grad)


def test_a_transpose_is_rewritten_as_the_permute_it_is():
    """`as_permute` on every kind of transpose an AOTAutograd graph holds: `t` of a matrix, a vector
    and a scalar, `transpose` of a 4-d tensor in the middle and from the end (negative dims). The
    rewritten graph has no transpose left and gives each output's values and strides, the layout
    a matrix product downstream would see."""
    def transposes(m, v, s, q):
        return m.t(), v.t(), s.t(), q.transpose(1, 2), q.transpose(-1, 0), q.transpose(-2, -1)

    inputs = (torch.randn(3, 5), torch.randn(4), torch.randn(()), torch.randn(2, 3, 4, 5))
    gm = make_fx(transposes)(*inputs)
    for node in gm.graph.find_nodes(op="call_function", target=TRANSPOSES[0]) + \
            gm.graph.find_nodes(op="call_function", target=TRANSPOSES[1]):
        as_permute(node)
    gm.recompile()
    assert not any(node.target in TRANSPOSES for node in gm.graph.nodes)
    for got, want in zip(gm(*inputs), transposes(*inputs), strict=True):
        assert torch.equal(got, want) and got.stride() == want.stride()


class UpsampledGradient(torch.autograd.Function):
    """2x, whose backward calls an op that inductor's C++ wrapper does not build on the CPU (torch
    2.13: `upsample_nearest2d` goes through the generic dispatcher, which is handed its absent
    optional `output_size` as `from(nullptr, 0)`; docs/design.md, "GPU runs")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return 2 * torch.nn.functional.interpolate(grad[None, None], scale_factor=1.0)[0, 0]


def test_a_backward_the_cpp_wrapper_cannot_build_runs_compiled_with_the_python_wrapper(monkeypatch):
    """A step graph whose C++ wrapper fails in g++ is compiled with the Python wrapper, not left
    to eager -- and the failure is met when the step graph compiles, not raised out of
    `loss.backward()` (AOTAutograd compiles a backward graph lazily by default)."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return UpsampledGradient.apply(x).sin()

    x = torch.randn(8, 8, requires_grad=True)
    graph = StepGraph(fn)
    with pytest.warns(RuntimeWarning, match=r"C\+\+ wrapper failed") as caught:
        graph(x).sum().backward()
    assert not [w for w in caught if "using eager" in str(w.message)]
    assert graph.error is None and graph.graphs == 1
    compiled_grad, x.grad = x.grad, None
    fn(x).sum().backward()
    assert torch.equal(compiled_grad, x.grad)


FAILURES_LEFT = {"runs": 0}  # runs of `fails_when_told` still to fail


@torch.library.custom_op("altgrad_test::fails_when_told", mutates_args=())
def fails_when_told(x: torch.Tensor) -> torch.Tensor:
    """x + 1, or a RuntimeError while FAILURES_LEFT says so: an op that fails at run time only."""
    if FAILURES_LEFT["runs"]:
        FAILURES_LEFT["runs"] -= 1
        raise RuntimeError("failed while running")
    return x + 1


@fails_when_told.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class CountingStep(torch.nn.Module):
    """A step that writes its state (a buffer, the generator) before an op that can fail, as a
    quantized forward updates its scalers' histories before the layers after them run."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return fails_when_told(x * torch.rand(x.shape))


def test_a_step_graph_that_fails_while_running_is_rolled_back_before_eager(monkeypatch):
    """A graph that compiles but fails at run time after writing state: the step then runs eagerly
    from the state it started from -- buffer and generator -- so it is applied once, as eager would."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    monkeypatch.setattr(Compiled, "registry", [])  # this failing graph stays out of compile_status
    monkeypatch.setitem(FAILURES_LEFT, "runs", 1)
    step, x = CountingStep(), torch.ones(64)
    graph = StepGraph(step)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="using eager"):  # (the C++ wrapper drops the op's message)
        out = graph(x)
    rng_after = torch.get_rng_state()
    assert graph.graphs == 1 and graph.error and FAILURES_LEFT["runs"] == 0
    assert step.calls.item() == 1  # not 2: the failed run's write was undone
    torch.manual_seed(0)
    assert torch.equal(out, fails_when_told(x * torch.rand(x.shape)))
    assert torch.equal(rng_after, torch.get_rng_state())  # one draw, not two


def test_a_step_graph_that_fails_after_running_before_raises_its_error(monkeypatch):
    """A graph that ran before and fails now has no rollback point: its error is raised as it is
    (it may be the data's, a device assert, not the compiler's), not hidden by running the step
    again on a partly updated state, and the compiler is not blamed for it."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    monkeypatch.setattr(Compiled, "registry", [])
    step, x = CountingStep(), torch.ones(64)
    graph = StepGraph(step)
    graph(x)
    monkeypatch.setitem(FAILURES_LEFT, "runs", 1)
    with pytest.raises(RuntimeError) as raised:
        graph(x)
    assert "not run again" in " ".join(getattr(raised.value, "__notes__", []))
    assert graph.error is None and graph.graphs == 1 and step.calls.item() == 1  # not run again eagerly


class BrokenStep(CountingStep):
    """Two graphs a call: a graph break between a buffer write and an op that can fail. `scale`
    (a Python number, guarded on) gives the first graph variants while the second stays one."""

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        self.calls.add_(1)
        y = x * scale
        torch._dynamo.graph_break()
        return fails_when_told(y)


@pytest.mark.parametrize("when", ["first call", "second graph ran before"])
def test_a_failure_after_a_graph_break_raises_rather_than_run_the_step_twice(monkeypatch, when):
    """After a graph break the first graph's writes are done when the second runs: a rollback point
    taken when the first compiled is stale once the second runs, and the call raises instead of
    rolling back half of it and running the step again. Both the second graph compiled in the
    failing call and one compiled before (the first graph new in this call) are checked."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    monkeypatch.setattr(Compiled, "registry", [])
    step, x = BrokenStep(), torch.ones(64)
    graph = StepGraph(step)
    calls = 0
    if when == "second graph ran before":
        graph(x, 1.0)
        calls = 1
    monkeypatch.setitem(FAILURES_LEFT, "runs", 1)
    with pytest.raises(RuntimeError):
        graph(x, 2.0)  # a new first graph (scale 2.0), then the second
    assert step.calls.item() == calls + 1 and graph.error is None


def test_a_rollback_point_puts_back_the_buffers_and_the_generator_but_not_the_weights():
    """What a rollback point restores: every input that does not require grad (buffers, the
    batch), in place, and the generator; not the weights, which a training forward does not write."""
    buffer, batch = torch.arange(4.0), torch.ones(3)
    weight = torch.nn.Parameter(torch.ones(2))
    torch.manual_seed(0)
    rollback = rollback_point([buffer, batch, weight, 3], "cpu")
    draw = torch.rand(5)
    with torch.no_grad():
        buffer.add_(1), batch.zero_(), weight.mul_(2)
    torch.rand(7)
    rollback()
    assert torch.equal(buffer, torch.arange(4.0)) and torch.equal(batch, torch.ones(3))
    assert torch.equal(weight, torch.full((2,), 2.0))
    assert torch.equal(torch.rand(5), draw)


@pytest.mark.parametrize("static", [False, True])
def test_a_static_kernel_compiles_each_shape_and_a_dynamic_one_shares_a_graph(static):
    """`static_shapes` (the kernels called every step on one run's tensors): a graph per shape,
    with no symbolic size to guard in Python; by default one graph serves every size."""
    kernel = Kernel(lambda x, s: x * s, static_shapes=static)
    for n in (8, 24, 40):
        x = torch.arange(n, dtype=torch.float32)
        torch.testing.assert_close(kernel(x, torch.tensor(3.0)), x * 3, rtol=0, atol=0)
    assert kernel.error is None
    assert counters["stats"]["unique_graphs"] == (3 if static else 1)


def test_a_kernel_raises_the_recompile_limit_in_every_thread_that_calls_it(monkeypatch):
    """Dynamo keeps its recompile limit per thread. A Ray worker that runs a second trial runs it
    in a new thread, where a kernel compiled in the first trial's thread met the default 8 and fell
    back to eager (a two-seed sweep with format shifts: `_moves_all` and `_encode_samples`, whose
    layer lists change with each shift). Every compiled call raises it in its own thread."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    kernel = Kernel(lambda x: x * 2 + 1)
    x = torch.arange(8.0)
    kernel(x)  # compiled here, in this thread
    seen = {}

    def other_thread() -> None:
        kernel(x)
        seen["limit"] = torch._dynamo.config.recompile_limit

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen["limit"] >= GRAPHS_PER_KERNEL and kernel.error is None
