"""Comparison helper shared by the quantizer tests."""

import torch


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (so -0 != +0), except that any NaN matches any NaN."""
    if a.dtype != b.dtype:
        a, b = a.double(), b.double()
    bits = {torch.float64: torch.int64, torch.float32: torch.int32}.get(a.dtype, torch.int16)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        a.view(bits).masked_fill(nan, 0), b.view(bits).masked_fill(nan, 0))
