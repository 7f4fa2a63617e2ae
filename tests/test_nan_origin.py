"""Tracing a non-finite step to the quantized layer it started in, on synthetic probe values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from altgrad.quant.formats import get_format
from altgrad.quant.linear import LinearQuantPolicy, QuantizedLinear
from altgrad.train.nan_origin import NanOrigin, first_nonfinite


class Toy(nn.Module):
    """Three quantized layers a -> b -> head, the head tied to an embedding like GPT's."""

    def __init__(self):
        super().__init__()
        fmt = get_format("e4m3")
        policy = LinearQuantPolicy(fmt, fmt, get_format("e5m2"))
        self.emb = nn.Embedding(8, 4)
        self.a = QuantizedLinear.from_float(nn.Linear(4, 4), policy)
        self.b = QuantizedLinear.from_float(nn.Linear(4, 4), policy)
        self.head = QuantizedLinear.from_float(nn.Linear(4, 8, bias=False), policy)
        self.emb.weight = self.head.weight


@pytest.fixture
def toy() -> tuple[Toy, NanOrigin]:
    model = Toy()
    layers = {"a": model.a, "b": model.b, "head": model.head}
    for layer in layers.values():
        for scaler in layer.scalers.values():
            scaler.amax.fill_(1.0)
    return model, NanOrigin(layers, model)


def origin_of(toy, bad: set[str]) -> list[str]:
    """Blame for a step whose probes named in `bad` ("loss", "<role>:<layer>", "wgrad:<layer>")
    are non-finite (inf or NaN alternately, both must count)."""
    model, locator = toy
    values = iter([math.inf, math.nan] * 8)
    for probe in bad:
        kind, _, name = probe.partition(":")
        if kind in ("input", "grad_output"):
            getattr(model, name).scalers[kind].amax.fill_(next(values))
    norms = {getattr(model, n).weight: torch.tensor(next(values) if f"wgrad:{n}" in bad else 1.0)
             for n in ("a", "b", "head")}
    loss = torch.tensor(next(values) if "loss" in bad else 2.0)
    return locator.blame(int(locator.first_bad(loss, norms)))


@pytest.mark.parametrize(("bad", "expected"), [
    (set(), []),
    ({"input:b", "input:head", "loss"}, ["a"]),  # a's output went bad: b sees it first
    ({"input:a", "loss"}, []),  # from the embeddings: no layer to shift
    ({"loss"}, ["head"]),
    ({"grad_output:head"}, ["head"]),  # the loss gradient of head's own output
    ({"grad_output:a", "wgrad:a"}, ["b"]),  # b's input gradient, processed just before a
    ({"grad_output:b", "wgrad:a", "grad_output:a"}, ["head"]),  # head runs first in backward
    ({"wgrad:b"}, ["b"]),
    ({"wgrad:b", "wgrad:a"}, ["b"]),  # b's weight gradient is computed before a's
    ({"wgrad:head"}, ["head", "a"]),  # tied: also collects a's input gradient via the embedding
    ({"wgrad:head", "wgrad:a"}, ["a"]),  # the tied gradient completes last
], ids=lambda v: ",".join(sorted(v)) if isinstance(v, set) else None)
def test_the_first_non_finite_probe_names_the_layer(toy, bad, expected):
    assert origin_of(toy, bad) == expected


def test_probes_follow_execution_order(toy):
    _, locator = toy
    assert locator.probes == [
        ("input", "a"), ("input", "b"), ("input", "head"), ("loss", ""),
        ("grad_output", "head"), ("grad_output", "b"), ("weight_grad", "b"),
        ("grad_output", "a"), ("weight_grad", "a"), ("weight_grad", "head"),
    ]


def test_first_nonfinite_index():
    assert first_nonfinite(torch.tensor([1.0, 2.0])).item() == -1
    assert first_nonfinite(torch.tensor([1.0, math.nan, -math.inf, 3.0])).item() == 1
    assert first_nonfinite(torch.tensor([-math.inf])).item() == 0
