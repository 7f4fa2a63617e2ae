"""compute_scale, AmaxHistory and TensorScaler: edge cases, modes, checkpointing, no host sync."""

import math
from contextlib import contextmanager

import pytest
import torch

from altgrad.quant import FORMATS, get_format, quantize
from altgrad.quant.scaling import AmaxHistory, TensorScaler, compute_scale
from altgrad.scaling_policy import ScalingPolicy

pytestmark = pytest.mark.usefixtures("eager_kernels")


@contextmanager
def no_host_sync(monkeypatch):
    """Fail on anything that reads a tensor value back to Python."""
    def sync(*args, **kwargs):
        raise AssertionError("host sync")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, sync)
        yield


def t(v: float) -> torch.Tensor:
    return torch.tensor(v)


def test_scale_is_rounded_down_to_a_power_of_two():
    assert compute_scale(t(1.0), "e4m3").item() == 256  # 448 -> 256
    assert compute_scale(t(448.0), "e4m3").item() == 1
    assert compute_scale(t(449.0), "e4m3").item() == 0.5
    assert compute_scale(t(3.5), "e4m3").item() == 128  # 448 / 3.5 = 128 exactly
    assert compute_scale(t(3.5000002), "e4m3").item() == 64
    assert compute_scale(t(3.4999998), "e4m3").item() == 128
    assert compute_scale(t(1e-3), "e5m2").item() == 2.0**25


def test_scale_keeps_amax_within_range_for_every_format():
    amax = torch.cat([torch.exp2(torch.linspace(-40, 40, 100_001)),
                      torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 1000])
    for f in FORMATS.values():
        s = compute_scale(amax, f)  # elementwise, so a whole batch of amax values at once
        assert (amax * s <= f.max).all() and (2 * amax * s > f.max).all()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_non_power_of_two_scale_is_one_correctly_rounded_division(mode, monkeypatch):
    """s = fmt.max / amax in one IEEE division (float / tensor would be a reciprocal and a product:
    two roundings, and amax * s > max for a third of all amax values), in compute_scale and in the
    compiled scaler step alike."""
    if mode == "compiled":
        monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    amax = torch.rand(4000, generator=torch.Generator().manual_seed(0)) * 100 + 1e-3
    for name in ("e4m3", "e5m2", "e2m5"):
        f = FORMATS[name]
        want = (torch.tensor(f.max, dtype=torch.float64) / amax.double()).float()  # correctly rounded
        assert torch.equal(compute_scale(amax, f, pow2=False), want)
        scaler = TensorScaler(f, ScalingPolicy("dynamic", pow2=False))
        for a in amax[:20]:
            assert scaler.update(torch.stack([a, -a / 2])) == want[amax == a][0]


def test_margin_and_exact_scales():
    assert compute_scale(t(1.0), "e4m3", margin=2).item() == 64
    assert compute_scale(t(1.0), "e4m3", margin=-1).item() == 512
    assert compute_scale(t(3.0), "e4m3", pow2=False).item() == pytest.approx(448 / 3, rel=1e-7)
    assert compute_scale(t(3.0), "e4m3", pow2=False, margin=1).item() == pytest.approx(448 / 6, rel=1e-7)


@pytest.mark.parametrize("amax", [0.0, math.inf, math.nan, -1.0, 1e-44])
def test_unusable_amax_keeps_the_previous_scale(amax):
    assert compute_scale(t(amax), "e4m3").item() == 1.0
    assert compute_scale(t(amax), "e4m3", prev_scale=t(8.0)).item() == 8.0
    assert compute_scale(t(amax), "e4m3", pow2=False, prev_scale=t(0.25)).item() == 0.25


def test_compute_scale_output_is_a_0dim_float32_tensor():
    s = compute_scale(torch.tensor(2.0, dtype=torch.bfloat16), FORMATS["e5m2"])
    assert s.shape == () and s.dtype == torch.float32


def test_amax_history_rolls_and_skips_non_finite_values():
    h = AmaxHistory(history_len=3, algo="max")
    for v in (1.0, 5.0, 2.0):
        h.record(t(v))
    assert h.amax_history.tolist() == [1.0, 5.0, 2.0] and h.estimate().item() == 5.0
    h.record(t(math.nan))
    h.record(t(math.inf))
    assert h.amax_history.tolist() == [1.0, 5.0, 2.0]
    h.record(t(3.0))
    h.record(t(0.5))
    assert h.amax_history.tolist() == [2.0, 3.0, 0.5] and h.estimate().item() == 3.0
    h.record(t(0.25))
    h.record(t(0.25))  # the 3.0 rolls out of the window
    assert h.estimate().item() == 0.5
    recent = AmaxHistory(history_len=3, algo="most_recent")
    for v in (4.0, 1.0):
        recent.record(t(v))
    assert recent.estimate().item() == 1.0


@pytest.mark.parametrize("kwargs", [dict(history_len=0), dict(algo="mean")])
def test_amax_history_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        AmaxHistory(**kwargs)


def test_bad_mode_is_rejected():
    with pytest.raises(ValueError, match="mode"):
        TensorScaler("e4m3", ScalingPolicy(mode="static"))
    with pytest.raises(ValueError, match="valid"):
        TensorScaler("fp8")


def test_mode_none_always_uses_the_raw_range():
    sc = TensorScaler("e4m3", ScalingPolicy(mode="none"))
    for x in (torch.ones(4) * 1000, torch.ones(4) * 1e-3):
        assert sc.update(x).item() == 1.0
    assert sc.amax.item() == pytest.approx(1e-3) and sc.amax_history[-2].item() == 1000


def test_dynamic_mode_scales_by_the_current_tensor():
    sc = TensorScaler("e4m3", ScalingPolicy(mode="dynamic"))
    assert sc.update(torch.tensor([0.5, -3.0])).item() == 128
    assert sc.update(torch.tensor([1000.0])).item() == 0.25
    assert sc.update(torch.full((3,), math.nan)).item() == 0.25  # NaN tensor: keep
    assert sc.update(torch.zeros(3)).item() == 0.25  # all-zero tensor: keep
    assert sc.amax.item() == 0.0


@pytest.mark.parametrize("mode", ["none", "dynamic", "delayed"])
def test_current_reads_the_scale_without_advancing_the_state(mode):
    sc = TensorScaler("e4m3", ScalingPolicy(mode=mode, history_len=3))
    for v in (3.0, 100.0):
        sc.update(torch.tensor([v]))
    state = {k: v.clone() for k, v in sc.state_dict().items()}
    x = torch.tensor([0.5, -7.0])
    expected = {"none": 1.0, "dynamic": 64.0, "delayed": 128.0}[mode]  # delayed: the last step's scale, not one from the new history
    assert sc.current(x).item() == expected
    assert all(torch.equal(v, sc.state_dict()[k]) for k, v in state.items())


def test_delayed_mode_scales_by_the_history_before_the_tensor():
    sc = TensorScaler("e4m3", ScalingPolicy(mode="delayed", history_len=2, algo="max"))
    assert sc.update(torch.tensor([3.0])).item() == 128  # empty history: bootstrap from x
    assert sc.update(torch.tensor([100.0])).item() == 128  # history [3]: x's 100 is not seen yet
    assert sc.update(torch.tensor([1.0])).item() == 4  # history [3, 100]
    assert sc.update(torch.tensor([1.0])).item() == 4  # history [100, 1]
    assert sc.update(torch.tensor([math.inf])).item() == 256  # history [1, 1]; inf not recorded
    assert sc.amax_history.tolist() == [1.0, 1.0] and sc.amax.item() == math.inf
    assert sc.update(torch.tensor([1.0])).item() == 256


@pytest.mark.parametrize("mode,algo", [("none", "max"), ("dynamic", "max"), ("delayed", "max"),
                                       ("delayed", "most_recent")])
def test_scale_needs_amax_says_whether_the_tensor_itself_sets_the_scale(mode, algo):
    """`scale_needs_amax` (the CPU step quantizes in the same loop as it reduces where it is False)
    against what the scaler does: the scale it returns for x and for 16 x (the same history, another
    amax) differ exactly where it needs the amax. Through a first step, a zero tensor (recorded,
    so `most_recent` reads 0 after it while `max` still sees the past) and a NaN one (not
    recorded)."""
    sc = TensorScaler("e4m3", ScalingPolicy(mode=mode, history_len=3, algo=algo))
    seen = []
    for v in (3.0, 0.0, math.nan, 5.0, 0.0, 0.0, 0.0, 2.0):
        other = TensorScaler("e4m3", sc.policy)
        other.load_state_dict(sc.state_dict())
        needs = sc.scale_needs_amax()
        assert needs == (sc.update(torch.tensor([v, -v / 2])).item() != other.update(t(1000.0)).item()), v
        seen.append(needs)
    yes, no = True, False
    assert seen == {("none", "max"): [no] * 8, ("dynamic", "max"): [yes] * 8,
                    ("delayed", "max"): [yes, no, no, no, no, no, no, yes],  # history_len 3: 5 rolls out
                    ("delayed", "most_recent"): [yes, no, yes, yes, no, yes, yes, yes]}[mode, algo]


def test_scale_needs_amax_reads_a_bf16_state():
    """numpy has no bfloat16: a scaler cast whole to bf16 is still read (widened first)."""
    sc = TensorScaler("e4m3").to(torch.bfloat16)
    assert sc.scale_needs_amax()
    sc.update(torch.tensor([3.0]))
    assert not sc.scale_needs_amax()


def test_delayed_most_recent_follows_the_last_step():
    sc = TensorScaler("e5m2", ScalingPolicy(mode="delayed", algo="most_recent"))
    sc.update(torch.tensor([1.0]))
    sc.update(torch.tensor([1024.0]))
    assert sc.update(torch.tensor([1.0])).item() == 32  # 57344 / 1024 -> 56 -> 32


def test_returned_scale_is_not_the_live_buffer():
    sc = TensorScaler("e4m3", ScalingPolicy(mode="dynamic"))
    s = sc.update(torch.tensor([1.0]))
    sc.update(torch.tensor([100.0]))
    assert s.item() == 256 and sc.scale.item() == 4


def test_state_dict_round_trip_resumes_identically():
    a = TensorScaler("e4m3", ScalingPolicy(mode="delayed", history_len=4))
    xs = [torch.randn(100) * 10**k for k in (0, 2, 1, -1, 0)]
    for x in xs[:3]:
        a.update(x)
    state = a.state_dict()
    assert set(state) == {"state"}  # history, scale and amax: one buffer
    # a checkpoint from when they were three buffers loads the same state
    three = {"amax_history": a.amax_history.clone(), "scale": a.scale.clone(), "amax": a.amax.clone()}
    for old in (False, True):
        b = TensorScaler("e4m3", ScalingPolicy(mode="delayed", history_len=4))
        b.load_state_dict(dict(three) if old else state)
        assert torch.equal(b.state, a.state)
    for x in xs[3:]:
        assert torch.equal(a.update(x), b.update(x))
    assert torch.equal(a.state, b.state)


@pytest.mark.parametrize("mode", ["none", "dynamic", "delayed"])
def test_update_never_syncs_with_the_host(mode, monkeypatch):
    sc = TensorScaler("e4m3", ScalingPolicy(mode=mode))
    xs = [torch.randn(64), torch.full((4,), math.nan), torch.zeros(4), torch.randn(8) * 1e3]
    with no_host_sync(monkeypatch):
        for x in xs:
            sc.update(x)
            compute_scale(sc.amax, "e4m3", prev_scale=sc.scale)


def test_scaled_quantization_uses_the_format_range():
    x = torch.randn(10_000) * 1e-4
    sc = TensorScaler("e4m3", ScalingPolicy(mode="dynamic"))
    s = sc.update(x)
    q = quantize(x, "e4m3", scale=s)
    assert q.abs().max() * s <= 448 and (q != 0).float().mean() > 0.99
    assert (quantize(x, "e4m3") != 0).float().mean() < 0.1  # unscaled: mostly flushed


@pytest.mark.parametrize("mode", ["delayed", "dynamic", "none"])
def test_set_format_rederives_the_scale_for_the_new_range_and_keeps_the_history(mode):
    """The emergency shift: e4m3 (max 448) to e3m4 (max 15.5) scales the same amax history into
    the narrower range at once; without scaling the scale stays 1."""
    sc = TensorScaler("e4m3", ScalingPolicy(mode=mode, history_len=3))
    sc.update(torch.full((4,), 3.0))
    history, before = sc.amax_history.clone(), sc.scale.clone()
    new = get_format("e3m4")
    sc.set_format(new)
    assert sc.fmt == new and torch.equal(sc.amax_history, history)
    if mode == "none":
        assert sc.scale == before == 1
    else:
        assert sc.scale == 2.0 ** math.floor(math.log2(new.max / 3.0)) != before  # 4, from 128
