"""QuantizedLinear and model surgery: identity when nothing is quantized, SQNR, presets, counters,
roles switched off and the gradient's own scaling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from bitwise import same_values
from torch import nn

from altgrad.model import GPT, GPTConfig
from altgrad.quant import compile_status, encode, get_format
from altgrad.quant.convert import LayerPolicy, convert_to_quantized, linear_layers, quantized_layers
from altgrad.quant.linear import ROLES, LinearQuantPolicy, QuantizedLinear
from altgrad.quant.quantize import quantize, straight_through
from altgrad.quant.scaling import TensorScaler, abs_max, compute_scale
from altgrad.quant.step import STATS_SAMPLE, TensorStats, quantize_step
from altgrad.scaling_policy import ScalingPolicy

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.square().sum() / (ref - approx).square().sum()))


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def test_policy_that_quantizes_nothing_is_bit_identical():
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(1))
    plain, converted = tiny_gpt(), tiny_gpt()
    assigned = convert_to_quantized(converted, LayerPolicy.build([("*", "bf16")], "e4m3"))
    assert assigned == {} and not quantized_layers(converted)
    assert torch.equal(plain(idx)[0], converted(idx)[0])
    quantized = tiny_gpt()
    convert_to_quantized(quantized, LayerPolicy.build("all", "e4m3"))
    assert not torch.equal(plain(idx)[0], quantized(idx)[0])  # the comparison can fail


def test_e4m3_linear_sqnr_matches_torchao_thresholds():
    torch.manual_seed(0)
    ref = nn.Linear(256, 128)
    fmt = get_format("e4m3")
    policy = LinearQuantPolicy(
        input=fmt, weight=fmt, grad_output=get_format("e5m2"), scaling=ScalingPolicy(mode="dynamic")
    )
    q = QuantizedLinear.from_float(nn.Linear(256, 128), policy)
    q.load_state_dict(ref.state_dict(), strict=False)
    x = torch.randn(64, 256)
    x_ref, x_q = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_q = ref(x_ref), q(x_q)
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y_q.backward(g)
    assert sqnr_db(y_ref, y_q) >= 18
    assert sqnr_db(x_ref.grad, x_q.grad) >= 17
    assert sqnr_db(ref.weight.grad, q.weight.grad) >= 17


def test_from_float_reuses_parameters_and_keeps_weight_tying():
    model = tiny_gpt()
    head, fc = model.lm_head.weight, model.transformer.h[0].mlp.c_fc.weight
    convert_to_quantized(model, LayerPolicy.build("all", "e5m2"))
    assert isinstance(model.lm_head, QuantizedLinear)
    assert model.lm_head.weight is head is model.transformer.wte.weight
    assert model.transformer.h[0].mlp.c_fc.weight is fc


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("all", lambda n: True),
        ("mlp", lambda n: ".mlp." in n),
        ("attn", lambda n: ".attn." in n),
        ("no_head", lambda n: n != "lm_head"),
    ],
)
def test_presets_quantize_exactly_the_layers_they_name(precision, expected):
    model = tiny_gpt()
    names = linear_layers(model)
    assigned = convert_to_quantized(model, LayerPolicy.build(precision, "e3m4"))
    want = {n for n in names if expected(n)}
    assert set(assigned) == want == set(quantized_layers(model))
    assert all(f.name == "e3m4" for f in assigned.values())


def test_custom_rules_first_match_wins_and_unmatched_pattern_is_an_error():
    model = tiny_gpt()
    rules = [("*.h.0.mlp.*", "e5m2"), ("*.mlp.*", "e2m5"), ("lm_head", "bf16")]
    assigned = convert_to_quantized(model, LayerPolicy.build(rules, "e4m3"))
    assert {n: f.name for n, f in assigned.items()} == {
        "transformer.h.0.mlp.c_fc": "e5m2",
        "transformer.h.0.mlp.c_proj": "e5m2",
        "transformer.h.1.mlp.c_fc": "e2m5",
        "transformer.h.1.mlp.c_proj": "e2m5",
    }
    with pytest.raises(ValueError, match=r"\*\.ffn\.\*"):
        convert_to_quantized(tiny_gpt(), LayerPolicy.build([("*.ffn.*", "e4m3")], "e4m3"))
    with pytest.raises(ValueError, match="unknown layer precision"):
        LayerPolicy.build("everything", "e4m3")


def test_overflow_underflow_and_histogram_counters():
    fmt = get_format("e4m3")
    policy = LinearQuantPolicy(
        input=fmt, weight=fmt, grad_output=fmt, scaling=ScalingPolicy(mode="none")
    )
    layer = QuantizedLinear.from_float(nn.Linear(4, 2, bias=False), policy)
    layer.collect_stats = True
    x = torch.tensor([[1000.0, -500.0, 1e-4, 0.0]])  # two overflow (> 448), one underflow, one zero
    layer(x)
    counts, hist = layer.stats["input"].counts()
    assert counts.tolist() == [2, 1, 4]
    assert hist.sum() == 4 and hist[encode(torch.tensor([448.0]), fmt).long()] == 1


def test_counters_count_the_tensors_as_they_were_observed():
    """A tensor changed in place after its observation (a reused gradient buffer) does not change
    what was counted; observations add up until `reset`."""
    fmt = get_format("e4m3")
    x = torch.tensor([1000.0, 1.0, 1e-4, 0.0])
    q = quantize(x, fmt)
    stats = TensorStats()
    stats.observe(x, q, fmt, torch.ones(()))
    expected = [t.clone() for t in stats.counts()]
    x.fill_(1e6)
    q.zero_()
    assert all(torch.equal(a, b) for a, b in zip(stats.counts(), expected, strict=True))
    assert expected[0].tolist() == [1, 1, 4]
    stats.observe(x, quantize(x, fmt), fmt, torch.ones(()))
    assert stats.counts()[0].tolist() == [5, 1, 8]
    stats.reset()
    assert stats.counts()[0].tolist() == [0, 0, 0] and stats.counts()[1].sum() == 0


@pytest.mark.parametrize("rows", [3, 2 * STATS_SAMPLE])  # counted whole, and on a sample
def test_grad_output_is_counted_as_the_gradient_backward_received(rows, eager_kernels):
    """grad_output is quantized in backward, counted when the forward was: it counts what observing
    that gradient directly counts."""
    fmt = get_format("e4m3")
    policy = LinearQuantPolicy(input=fmt, weight=fmt, grad_output=fmt, scaling=ScalingPolicy(mode="none"))
    layer = QuantizedLinear.from_float(nn.Linear(4, 2, bias=False), policy)
    layer.collect_stats = True
    y = layer(torch.randn(rows, 2, 4, requires_grad=True))
    g = torch.tensor([1000.0, 1e-4, 0.0, 1.0]).repeat(rows)[:y.numel()].view_as(y)
    y.backward(g)
    direct = TensorStats()
    direct.observe(g, quantize(g, fmt), fmt, torch.ones(()))
    for got, want in zip(layer.stats["grad_output"].counts(), direct.counts(), strict=True):
        assert torch.equal(got, want)
    assert layer.stats["grad_output"].counts()[0][0] > 0  # the overflowing entries were seen
    layer.stats["grad_output"].reset()
    assert layer.stats["grad_output"].counts()[0].tolist() == [0, 0, 0]


def test_counters_on_large_tensors_estimate_the_rates_from_a_sample():
    fmt = get_format("e5m2")
    policy = LinearQuantPolicy(input=fmt, weight=fmt, grad_output=fmt, scaling=ScalingPolicy(mode="none"))
    layer = QuantizedLinear.from_float(nn.Linear(64, 2, bias=False), policy)
    layer.collect_stats = True
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40_000, 64, generator=gen)  # 2.56M elements: sampled
    hot = torch.rand(x.shape, generator=gen) < 0.05
    x[hot] = 1e6  # 5 % overflow (> 57344)
    layer(x)
    overflow, _, n = layer.stats["input"].counts()[0].tolist()
    histogram = layer.stats["input"].counts()[1]
    assert histogram.sum() < n == x.numel() and abs(overflow / n - hot.float().mean().item()) < 0.005


@pytest.mark.parametrize("fmt", ["e4m3", "e7m0", "e0m7"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("mode", ["delayed", "dynamic", "none"])
def test_fused_step_equals_the_separate_calls(fmt, rounding, mode, path):
    """quantize_step (one kernel, counting) against scaler.update + quantize + TensorStats.observe,
    over steps that grow, zero and poison the amax (one tensor counted whole, one sampled).
    Both share `scaling.next_scale` and `record_step`: this checks the fusion; test_scaling.py checks the scaling
    itself against compute_scale and the history."""
    check_fused_step(fmt, rounding, mode, pow2=True)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("mode", ["delayed", "dynamic"])
def test_fused_step_with_scales_that_are_no_powers_of_two(rounding, mode, path):
    """`quantize` divides by the scale; the step multiplies by its inverse only where the scales are
    powers of two (`kernels.unscale`). With `pow2` off it must divide too."""
    check_fused_step("e4m3", rounding, mode, pow2=False)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fused_step_scaled_by_the_most_recent_amax(rounding, path):
    """With `most_recent` the history's last entry decides: after the zero tensor it is 0, so the
    steps that follow scale by their own amax again, which the CPU step must see before it
    quantizes (`TensorScaler.scale_needs_amax`), while `max` still reads the past."""
    check_fused_step("e4m3", rounding, "delayed", pow2=True, algo="most_recent")


def test_a_cpu_step_reduces_inside_its_compiled_call_once_the_scale_is_known(monkeypatch):
    """On the CPU the amax is reduced in the step's compiled call, in the loop that quantizes; only
    a step whose scale needs the tensor's own amax (here the first: empty history) reduces it
    eagerly before. An eager `aminmax` on every step is a whole extra pass over the logits gradient
    (docs/design.md)."""
    monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    warm = TensorScaler("e4m3")
    for _ in range(2):
        quantize_step(x, warm)

    def eager_reductions(scaler: TensorScaler) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            quantize_step(x, scaler)
        return sum(e.name == "aten::aminmax" for e in prof.events())

    assert compile_status() == "compiled"
    scaler = TensorScaler("e4m3")
    assert [eager_reductions(scaler) for _ in range(3)] == [1, 0, 0]


def check_fused_step(fmt: str, rounding: str, mode: str, pow2: bool, algo: str = "max") -> None:
    f = get_format(fmt)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, 48, generator=gen) * 3, torch.randn(64, 48, generator=gen) * 1e4,
          torch.zeros(64, 48), torch.full((64, 48), float("nan")),
          torch.randn(300, 300, generator=gen) * 1e-3]
    fused, separate = (TensorScaler(f, ScalingPolicy(mode, history_len=3, algo=algo, pow2=pow2)) for _ in range(2))
    fused_stats, separate_stats = TensorStats(), TensorStats()
    for i, x in enumerate(xs):
        torch.manual_seed(i)
        q, s = quantize_step(x, fused, rounding, fused_stats)
        torch.manual_seed(i)
        s_ref = separate.update(x)
        q_ref = quantize(x, f, s_ref, rounding=rounding)
        separate_stats.observe(x, q_ref, f, s_ref)
        assert same_values(q, q_ref) and same_values(s, s_ref), i
        for a, b in [(fused.amax_history, separate.amax_history), (fused.scale, separate.scale)]:
            assert same_values(a, b), i
        assert torch.equal(fused_stats.counted, separate_stats.counted), i
    # the 90k tensor was sampled (its histogram holds STATS_SAMPLE elements), its counts stand for all of it
    assert fused_stats.counts()[1].sum() == 4 * 64 * 48 + STATS_SAMPLE
    assert fused_stats.counts()[0][2] == sum(x.numel() for x in xs)



def test_a_float64_tensor_is_counted_like_its_float32_values(path):
    """The counters encode in float32 whatever the tensor's dtype: a float64 tensor holding float32
    values counts what the float32 tensor does (its grid constants are float64's, not the codes')."""
    f = get_format("e4m3")
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 100
    counted = []
    for t in (x, x.double()):
        stats = TensorStats()
        quantize_step(t, TensorScaler(f, ScalingPolicy("dynamic")), "nearest", stats)
        counted.append(stats.counted)
    assert torch.equal(*counted) and int((counted[0][3:] > 0).sum()) > 100


# --- roles switched off, and the gradient's own scaling ---------------------------------------


def ste(x: torch.Tensor, fmt) -> torch.Tensor:
    """x fake-quantized with dynamic per-tensor scaling and a straight-through gradient, from the
    public quantizer alone: the reference for a quantized input or weight."""
    s = compute_scale(abs_max(x), fmt)
    return straight_through(x, quantize(x, fmt, s), fmt, s, False)


class ForwardQuantized(nn.Module):
    """Reference layer: input and weight fake-quantized, the gradient left alone."""

    def __init__(self, linear: nn.Linear, fmt):
        super().__init__()
        self.linear, self.fmt = linear, fmt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(ste(x, self.fmt), ste(self.linear.weight, self.fmt), self.linear.bias)


def loss_and_grads(model: nn.Module, params: list[nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, 50257, (2, 16), generator=gen) for _ in range(2))
    logits, loss = model(idx, targets)
    loss.backward()
    return logits.detach(), [p.grad.clone() for p in params]


def template(**settings) -> LinearQuantPolicy:
    """The settings every quantized layer shares (LayerPolicy's default, changed by `settings`);
    input and weight formats come from the rules."""
    return replace(LayerPolicy(rules=()).template, **settings)


def same_run(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_all_roles_off_is_bit_identical_to_the_unconverted_model(eager_kernels):
    plain, converted = tiny_gpt(), tiny_gpt()
    convert_to_quantized(converted, LayerPolicy.build("all", "e4m3", template(quantized=())))
    for layer in quantized_layers(converted).values():
        layer.collect_stats = True
    want = loss_and_grads(plain, list(plain.parameters()))
    assert same_run(loss_and_grads(converted, list(converted.parameters())), want)
    for layer in quantized_layers(converted).values():  # no scaling state, nothing counted
        for role in ROLES:
            scaler = layer.scalers[role]
            assert not scaler.amax_history.any() and scaler.scale == 1 and scaler.amax == 0
            assert not layer.stats[role].counted.any()
    on = tiny_gpt()
    convert_to_quantized(on, LayerPolicy.build("all", "e4m3"))
    assert not same_run(loss_and_grads(on, list(on.parameters())), want)  # the comparison can fail


def test_grad_output_off_leaves_the_gradient_of_the_quantized_forward(eager_kernels):
    """Forward-only quantization: the gradients are those of the quantized-forward graph, exactly,
    against a reference built from the public quantizer; quantizing grad_output changes them."""
    fmt = get_format("e4m3")
    dynamic = ScalingPolicy(mode="dynamic")  # the scale depends on the tensor alone, as in `ste`
    forward_only = tiny_gpt()
    convert_to_quantized(forward_only, LayerPolicy.build("all", "e4m3", template(scaling=dynamic,
                                                                  quantized=("input", "weight"))))
    reference = tiny_gpt()
    for name in linear_layers(reference):
        parent, _, child = name.rpartition(".")
        module = reference.get_submodule(parent)
        setattr(module, child, ForwardQuantized(getattr(module, child), fmt))
    got = loss_and_grads(forward_only, list(forward_only.parameters()))
    assert same_run(got, loss_and_grads(reference, list(reference.parameters())))
    layers = quantized_layers(forward_only).values()
    assert all(layer.scalers["grad_output"].amax == 0 for layer in layers)
    assert all(layer.scalers["input"].amax > 0 for layer in layers)
    full = tiny_gpt()
    convert_to_quantized(full, LayerPolicy.build("all", "e4m3", template(scaling=dynamic)))
    logits, grads = loss_and_grads(full, list(full.parameters()))
    assert torch.equal(logits, got[0]) and not all(map(torch.equal, grads, got[1]))


def test_a_role_off_is_not_counted(eager_kernels):
    fmt = get_format("e4m3")
    policy = LinearQuantPolicy(input=fmt, weight=fmt, grad_output=fmt, quantized=("weight",))
    layer = QuantizedLinear.from_float(nn.Linear(8, 4), policy)
    layer.collect_stats = True
    layer(torch.randn(3, 8, requires_grad=True)).sum().backward()
    assert [bool(layer.stats[r].counted.any()) for r in ROLES] == [False, True, False]
    assert "input=off" in repr(layer) and "grad_output=off" in repr(layer)
    with pytest.raises(ValueError, match="grad_input"):
        LinearQuantPolicy(input=fmt, weight=fmt, grad_output=fmt, quantized=("grad_input",))


def test_grad_scaling_none_quantizes_the_gradient_in_the_raw_format(eager_kernels):
    """e4m3 gradients of ~1e-3 sit below the unscaled format's smallest subnormal (2^-9) for the
    most part: with grad_scaling mode none they are the raw quantizer's values (mostly flushed to
    zero), with delayed scaling they survive; the forward keeps `scaling` either way."""
    fmt = get_format("e4m3")
    delayed = ScalingPolicy(mode="delayed")
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(16, 8)
    x = torch.randn(32, 16, generator=gen)
    g = torch.randn(32, 8, generator=gen) * 1e-3

    def input_grad(policy: LinearQuantPolicy, grad: torch.Tensor) -> tuple[torch.Tensor, QuantizedLinear]:
        layer = QuantizedLinear.from_float(linear, policy)
        xi = x.clone().requires_grad_()
        layer(xi).backward(grad)
        return xi.grad, layer

    both = dict(input=fmt, weight=fmt, grad_output=fmt, scaling=delayed)
    raw, layer = input_grad(LinearQuantPolicy(**both, grad_scaling=ScalingPolicy(mode="none")), g)
    assert layer.scalers["grad_output"].policy.mode == "none" and layer.scalers["input"].policy.mode == "delayed"
    unquantized_grad = LinearQuantPolicy(**both, quantized=("input", "weight"))
    assert torch.equal(raw, input_grad(unquantized_grad, quantize(g, fmt))[0])  # the raw quantizer
    scaled, _ = input_grad(LinearQuantPolicy(**both), g)  # grad_scaling None: `scaling`, delayed
    assert not torch.equal(raw, scaled)
    assert sqnr_db(g @ linear.weight.detach(), scaled) > sqnr_db(g @ linear.weight.detach(), raw) + 10
