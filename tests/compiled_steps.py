"""A compiled and an eager trainer stepped side by side, and the checks that they are bit-identical
and that a compiled run resumes exactly (tests/test_kernels.py on the CPU, tests/test_cuda.py on a
GPU)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from bitwise import same_values
from torch._dynamo.utils import counters

from altgrad.quant.kernels import rollback_point
from altgrad.train import Trainer

# One layer 16 wide: every quantizer and diagnostic of a step, compiled in seconds.
TINY = ("model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=8", "train.batch_size=2",
        "train.shadow_every=0", "train.diag_every=1", "train.eval_interval=4")
# Metrics that are float sums over a tensor, with how far apart they may be. Kurtosis, inside the
# graph: the step graph's fused loop and the kernel's own graph may add in a different order. With
# the reference's kernels as plain functions, also the gradients' l2 and SNR, after the backward: a
# compiled kernel and its plain function add in a different order (float32 sums of up to ~10^6
# terms, the tied head: typically ~sqrt(n) eps = 1e-4 apart; measured up to 9e-6). Everything else
# -- the loss, every weight, scale and counter -- must match bit for bit.
SUMMED = {"act/kurtosis": 1e-5}
SUMMED_BY_FUNCTIONS = {**SUMMED, "grad/l2": 1e-4, "grad/snr": 1e-4}
# Every quantized layer adds kernels to the step graph's C++ compile, so few layers are quantized:
# two format families (E?M0 with its tie fix-up; e5m2, whose unscaled overflow becomes inf) in one
# model, and stochastic rounding with format-stored weights, re-quantized stochastically too (their
# bit-stall reads the stored codes), on one layer. The other layers are in the graph unquantized.
MIXED = ("quant.format=e4m3", "quant.precision=[{pattern: lm_head, format: e7m0}, "
         "{pattern: '*.attn.c_proj', format: e5m2}]")
STOCHASTIC = ("quant.format=e3m4", "quant.rounding=stochastic", "quant.master_weights=format",
              "quant.weight_rounding=stochastic", "quant.precision=[{pattern: '*.mlp.c_proj', format: '{fmt}'}]")


def eager_and_compiled(make_config, tmp_path, *overrides: str) -> tuple[Trainer, Trainer]:
    """Two trainers of one config, `train.compile` off and on, each in a run directory of its own
    (made here: train_step without fit still writes bit positions there)."""
    trainers = []
    for name, on in (("eager", False), ("compiled", True)):
        (tmp_path / name).mkdir(exist_ok=True)
        trainers.append(Trainer(make_config(*overrides, f"train.compile={on}"), tmp_path / name))
    return trainers[0], trainers[1]


@contextmanager
def kernel_functions(on: bool) -> Iterator[None]:
    """With `on`, the quantizer kernels run as their plain functions, uncompiled (ALTGRAD_NO_COMPILE,
    read at each call), for a reference trainer: the compiled step is then checked against the
    model's own eager ops, and a model's per-tensor kernels, each a cold compile, are not compiled
    at all (~40 s of the CPU's mixed-format test)."""
    saved = os.environ.get("ALTGRAD_NO_COMPILE")
    if on:
        os.environ["ALTGRAD_NO_COMPILE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("ALTGRAD_NO_COMPILE", None)
        else:
            os.environ["ALTGRAD_NO_COMPILE"] = saved


def assert_step_identical(eager: Trainer, compiled: Trainer, step: int, functions: bool = False) -> None:
    """The same step on both trainers, from the same generator states (the CPU's and those of the
    trainers' device: stochastic rounding draws from them), gives the same metrics and weights; the
    eager one's kernels compiled each on its own or, with `functions`, as plain functions."""
    same_generators = rollback_point([], eager.device.type)
    with kernel_functions(functions):
        a = eager.train_step(step).metrics
    same_generators()
    b = compiled.train_step(step).metrics
    assert a.keys() == b.keys()
    summed = SUMMED_BY_FUNCTIONS if functions else SUMMED
    for key, value in a.items():
        if rel := next((rel for prefix, rel in summed.items() if key.startswith(prefix)), None):
            assert b[key] == pytest.approx(value, rel=rel), (step, key)
        else:
            assert value == b[key] or (value != value and b[key] != b[key]), (step, key, value, b[key])
    for (name, p), q in zip(eager.model.state_dict().items(), compiled.model.state_dict().values(), strict=True):
        assert same_values(p, q), (step, name)


class Interrupt(Exception):
    """Stands in for a killed process: raised from the report callback mid-run."""


def assert_exact_resume(make_config, tmp_path, *overrides: str, functions: bool = False) -> tuple[Trainer, int]:
    """A compiled run killed after step 8 and resumed from step 5's checkpoint ends where an
    uninterrupted eager one does (its kernels as `assert_step_identical`'s), bit for bit. Returns
    the resumed trainer and how many of its graphs it took from AOTAutograd's cache (the killed run
    compiled the same ones)."""
    common = (*overrides, "train.max_steps=12", "train.checkpoint_interval=5")
    straight = Trainer(make_config(*common, "train.compile=false"), tmp_path / "straight")
    with kernel_functions(functions):
        straight.fit()

    def stop(metrics, ckpt):
        if metrics["step"] == 8:
            raise Interrupt

    compiled = make_config(*common, "train.compile=true")
    with pytest.raises(Interrupt):
        Trainer(compiled, tmp_path / "resumed").fit(report=stop)
    resumed = Trainer(compiled, tmp_path / "resumed")
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    resumed.fit(resume=tmp_path / "resumed")
    hits = counters["aot_autograd"]["autograd_cache_hit"] - hits
    for (name, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(),
                            strict=True):
        assert same_values(p, q), name
    return resumed, hits
