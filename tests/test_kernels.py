"""The step graph (`kernels.StepGraph`, `train.compile`): a whole forward and backward in one
compiled graph, bit for bit what the eager model computes, with a bounded number of graphs, and
resuming exactly."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx.passes.regional_inductor
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.regional_inductor import regional_inductor

from altgrad.quant import compile_status
from altgrad.quant.kernels import drop_identity_ops
from altgrad.train import Trainer
from altgrad.train.format_shift import shift_layers

# One layer 16 wide: every quantizer and diagnostic of a step, compiled in seconds.
TINY = ("model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=8", "train.batch_size=2",
        "train.shadow_every=0", "train.diag_every=1", "train.eval_interval=4")
# Metrics that are float sums over a tensor and computed inside the graph (kurtosis, in the
# forward): inductor's region and the kernel's own graph may add in a different order. Everything
# else -- the loss, every weight, scale and counter -- must match bit for bit.
SUMMED = ("act/kurtosis",)


@pytest.fixture(autouse=True)
def fresh_counters():
    """Dynamo's counters are process-wide: count this test's graphs and graph breaks only."""
    counters.clear()


@pytest.fixture(autouse=True)
def run_dirs(tmp_path):
    """train_step without fit writes bit positions to the run directory: make the ones used here."""
    for name in ("eager", "compiled"):
        (tmp_path / name).mkdir()


def step_both(eager: Trainer, compiled: Trainer, step: int) -> tuple[dict, dict]:
    """The same step on both trainers from the same RNG state (stochastic rounding draws from it)."""
    rng = torch.get_rng_state()
    a = eager.train_step(step).metrics
    torch.set_rng_state(rng)
    return a, compiled.train_step(step).metrics


def assert_identical(eager: Trainer, compiled: Trainer, a: dict, b: dict, step: int) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if key.startswith(SUMMED):
            assert b[key] == pytest.approx(value, rel=1e-5), (step, key)
        else:
            assert value == b[key] or (value != value and b[key] != b[key]), (step, key, value, b[key])
    for (name, p), q in zip(eager.model.state_dict().items(), compiled.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), (step, name)


# Every compiled region costs a C++ compile (~2 s here), so few layers are quantized: two format
# families (E?M0 with its tie fix-up; e5m2, whose unscaled overflow becomes inf) in one model, and
# stochastic rounding with format-stored weights on one layer. The other layers are in the graph
# unquantized.
MIXED = ("quant.format=e4m3", "quant.precision=[{pattern: lm_head, format: e7m0}, "
         "{pattern: '*.attn.c_proj', format: e5m2}]")
STOCHASTIC = ("quant.format=e3m4", "quant.rounding=stochastic", "quant.master_weights=format",
              "quant.precision=[{pattern: '*.mlp.c_proj', format: '{fmt}'}]")


# What `drop_identity_ops` removes from a step graph, but where it would alias or convert.
RENAMING_OPS = (torch.ops.aten.detach.default, torch.ops.aten.copy.default)
RESHAPES_AND_CLONES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.clone.default)


def region_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The calls of compiled inductor regions in a graph that `regional_inductor` returned."""
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and type(getattr(n.target, "__wrapped__", None)).__name__ == "AOTCompiledArtifact"]


def fed_by_region(node: torch.fx.Node, regions: set[torch.fx.Node]) -> bool:
    """Whether an input of `node` is an output of one of `regions` (a getitem of its result)."""
    return any(arg in regions or (arg.target is operator.getitem and arg.args[0] in regions)
               for arg in node.all_input_nodes)


@pytest.mark.parametrize("quant", [MIXED, STOCHASTIC, ("quant.format=bf16",)], ids=["mixed", "stochastic", "bf16"])
def test_compiled_step_is_bit_identical_to_eager(make_config, tmp_path, monkeypatch, quant):
    """`train.compile: false` is the eager model calling each (compiled) kernel on its own; the
    kernels are bit-identical to their eager functions (test_quantize). Each quantized layer's
    quantizers (and its input's kurtosis) are one region per graph, fed by no other region: an
    earlier layer's state update is not deferred into a later layer's region. Then the recompile
    guard: 20 more steps, each with its own lr, compile nothing new, and an emergency format shift
    at most one more graph."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    graphs = []

    def recording(gm, example_inputs):
        out = regional_inductor(gm, example_inputs)
        graphs.append(gm)
        return out

    monkeypatch.setattr(torch.fx.passes.regional_inductor, "regional_inductor", recording)
    eager, compiled = (Trainer(make_config(*TINY, *quant, "train.max_steps=100", f"train.compile={on}"),
                               tmp_path / name)
                       for name, on in (("eager", False), ("compiled", True)))
    for step in range(1, 11):  # diagnostics every step, an evaluation (eager) at 1, 4 and 8
        a, b = step_both(eager, compiled, step)
        assert_identical(eager, compiled, a, b, step)
    assert compile_status() == "compiled"
    assert counters["graph_break"] == {}

    step_graphs, all_graphs = compiled.forward.graphs, counters["stats"]["unique_graphs"]
    assert step_graphs == 1  # training with diagnostics (evaluation runs the eager model)
    forward, backward = (region_calls(gm) for gm in graphs)
    grad_quantized = [n for n, layer in compiled.layers.items() if layer.policy.quantizes("grad_output")]
    assert (len(forward), len(backward)) == (len(compiled.diagnostics.linears), len(grad_quantized))
    assert not any(fed_by_region(n, set(calls)) for calls in (forward, backward) for n in calls)
    # every detach and buffer-update copy was dropped (`drop_identity_ops`), and so was every reshape
    # to its input's own shape and every clone of a computed tensor, but the graph's outputs
    outside = [(n, n.args[0].meta["val"].shape) for gm in graphs for n in gm.graph.nodes
               if n.target in RESHAPES_AND_CLONES and gm.graph.output_node() not in n.users]
    assert len(outside) > 10  # (so the checks below have reshapes to look at)
    renames = [n for gm in graphs for n in gm.graph.nodes
               if n.target in RENAMING_OPS and gm.graph.output_node() not in n.users]
    no_ops = [n for n, shape in outside if n.meta["val"].shape == shape and n.target != torch.ops.aten.clone.default]
    clones = [n for n, _ in outside if n.target == torch.ops.aten.clone.default and n.args[0].op != "placeholder"]
    assert not renames and not no_ops and not clones
    lrs = {compiled.train_step(step).metrics["train/lr"] for step in range(11, 31)}
    assert len(lrs) == 20
    assert compiled.forward.graphs == step_graphs and counters["stats"]["unique_graphs"] == all_graphs
    if compiled.layers:
        assert shift_layers(compiled.layers, [next(iter(compiled.layers))], "test")
        compiled.train_step(31)
        assert compiled.forward.graphs == step_graphs + 1  # a layer's format is part of the graph


def test_drop_identity_ops_keeps_what_would_alias_or_convert():
    """Only a detach that is not an output, and a copy of a fresh single-use tensor laid out like
    its buffer, go. A detach that is an output stays, and so does a copy from a view (it would hand
    out the input), from a tensor used elsewhere too, or into another dtype (a conversion). The
    graph computes the same values, dtypes included."""
    def step(buffer, counts, x):
        returned = torch.ops.aten.detach.default(buffer)
        doubled = torch.ops.aten.detach.default(x) * 2
        from_view = torch.ops.aten.copy.default(buffer, x.view(4))
        update = torch.ops.aten.copy.default(buffer, doubled)
        shared = x + 1
        from_shared = torch.ops.aten.copy.default(buffer, shared)
        converted = torch.ops.aten.copy.default(counts, x * 3)
        return returned, from_view, update, shared, from_shared, converted

    args = torch.zeros(4), torch.zeros(4, dtype=torch.int32), torch.arange(4.0)
    gm = make_fx(step)(*args)
    before = [n.target for n in gm.graph.nodes]
    drop_identity_ops(gm)
    after = [n.target for n in gm.graph.nodes]
    assert [before.count(op) - after.count(op) for op in RENAMING_OPS] == [1, 1]
    for got, want in zip(gm(*args), step(*args), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_drop_identity_ops_drops_no_op_reshapes_and_clones_and_shortens_reshape_chains():
    """A reshape to its input's own shape goes, a reshape of a reshape of a contiguous tensor reads
    that tensor, and a clone of a computed tensor (or of a view of one) goes. A clone of an input
    stays (it would alias the input, which a buffer update may overwrite), and so does a clone of a
    view at another storage offset (`as_strided` would read other elements), a no-op reshape or clone
    whose result is an output stays, and so does a reshape chain over a non-contiguous tensor. The
    graph computes the same values with the same strides."""
    aten = torch.ops.aten

    def step(x, m):
        y = x * 2
        same = aten.view.default(y, [4, 3])  # no-op
        flat = aten.view.default(same, [12])
        pair = aten._unsafe_view.default(flat, [2, 6])  # of a reshape of y
        of_computed = aten.clone.default(pair + 1)
        of_view = aten.clone.default(aten.view.default(y * 3, [3, 4]))
        of_input = aten.clone.default(x)
        split = aten.view.default(aten.t.default(m), [2, 2, 3])
        merged = aten.view.default(split, [4, 3])  # of a reshape of a transposed m
        out_same = aten.view.default(y * 4, [4, 3])
        out_clone = aten.clone.default(y * 5)
        no_op = aten.view.default(y * 6, [4, 3])
        of_offset_view = aten.clone.default(aten.slice.Tensor(y * 7, 0, 2, 4))  # rows 2-3: offset 6
        return (of_computed * 1, of_view * 1, of_input * 1, merged * 1, out_same, out_clone, no_op * 1,
                aten.as_strided.default(of_offset_view, [2, 3], [3, 1], 0))

    args = torch.arange(12.0).view(4, 3), torch.arange(12.0).view(3, 4)
    gm = make_fx(step, tracing_mode="fake")(*args)  # fake tensors keep views' storage offsets, as in a step graph
    drop_identity_ops(gm)
    kept = {n.name: [a.name for a in n.all_input_nodes] for n in gm.graph.nodes
            if n.target in (aten.view.default, aten._unsafe_view.default, aten.clone.default)}
    assert kept == {"_unsafe_view": ["mul"],  # pair, read from y itself
                    "view_2": ["mul_1"],  # the view of y * 3 (its clone went)
                    "clone_2": ["x_1"], "view_3": ["t"], "view_4": ["view_3"],
                    "view_5": ["mul_2"], "clone_3": ["mul_3"], "clone_4": ["slice_1"]}
    for got, want in zip(gm(*args), step(*args), strict=True):
        assert torch.equal(got, want) and got.stride() == want.stride()


class Interrupt(Exception):
    """Stands in for a killed process: raised from the report callback mid-run."""


def test_resume_with_the_compiled_step_is_bit_identical(make_config, tmp_path, monkeypatch):
    """Killed after step 8 and resumed from step 5's checkpoint, a compiled run ends where an
    uninterrupted eager one does, bit for bit."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    common = (*TINY, *MIXED, "train.max_steps=12", "train.checkpoint_interval=5")
    straight = Trainer(make_config(*common, "train.compile=false"), tmp_path / "straight")
    straight.fit()

    def stop(metrics, ckpt):
        if metrics["step"] == 8:
            raise Interrupt

    compiled = make_config(*common, "train.compile=true")
    with pytest.raises(Interrupt):
        Trainer(compiled, tmp_path / "resumed").fit(report=stop)
    resumed = Trainer(compiled, tmp_path / "resumed")
    resumed.fit(resume=tmp_path / "resumed")
    assert resumed.forward.graphs > 0
    for (name, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(),
                            strict=True):
        assert torch.equal(p, q), name
