"""The tests' bit-for-bit comparison (`bitwise.same_values`) itself: NaN matches NaN, -0 is not +0,
and a state of any dtype compares (a checkpoint holds integer counters and generator bytes)."""

import torch
from bitwise import same_values


def test_nan_matches_nan_and_zeros_keep_their_sign():
    a = torch.tensor([1.0, float("nan"), 0.0])
    assert same_values(a, a.clone())
    assert not same_values(a, torch.tensor([1.0, 2.0, 0.0]))
    assert not same_values(a, torch.tensor([1.0, float("nan"), -0.0]))


def test_every_dtype_of_a_state_compares():
    values = torch.tensor([0.5, -2.0, 0.0])
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        x = values.to(dtype)
        assert same_values(x, x.clone()) and not same_values(x, (-values).to(dtype)), dtype
    for t in (torch.arange(5, dtype=torch.int64), torch.arange(5, dtype=torch.uint8), torch.get_rng_state(),
              torch.tensor([True, False])):
        other = t.clone()
        other[0] = ~other[0] if t.dtype == torch.bool else other[0] + 1
        assert same_values(t, t.clone()) and not same_values(t, other), t.dtype
