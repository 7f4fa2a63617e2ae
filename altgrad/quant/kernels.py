"""The quantizer's arithmetic, and the machinery that compiles it: the API every kernel builds on.

Exact rounding onto a format's grid (no log2, no tables, no integer bit-casts in the hot loop):
with P the container's mantissa width (23 for float32) and e = floor(log2 |y|) clamped to the
format's [emin, emax], build the magic number 2^(e + P - mbits) exactly -- clamp |y| * 2^(P - mbits)
to the format's binades, keep its leading bit with a Veltkamp split, halve if that rounded up. Then
(|y| + magic) - magic is |y| rounded by the FPU to a multiple of the format's ULP 2^(e - mbits),
ties to even: exact, and the same ops in eager and in the inductor kernel (compiled with FP
contraction and unsafe-math reassociation pinned off, and on CUDA with IEEE division and subnormals
kept). Only E?M0 needs a fix-up: there the even *multiple* is not always the even *code* (1.5 * 2^e
must go to whichever of 2^e, 2^(e+1) has the even exponent field). Overflow then saturates or
becomes inf/NaN, and the sign is copied back, so -0 stays -0 and NaN propagates. Stochastic
rounding uses the same ULP: floor(|y| / ULP + U) * ULP.

A format enters a kernel as `grid_params`, one small tensor, not as constants, so one compiled graph
serves every format of a `family` (E?M0 and flush-to-zero formats, input dtypes and the rounding
mode add graphs). Its entries are named by the index constants below (`p[MAX]`, not `p[3]`). Inside
a step graph, which is compiled per format anyway, the same entries are literals instead
(`constants`).

`Kernel` compiles a function lazily with `torch.compile(dynamic=True)`: one compiled call per
quantized tensor. `StepGraph` compiles a whole model forward (and, through AOTAutograd, its
backward) as one graph instead, in inductor's "lite" mode: every op the kernels trace is lowered by
inductor with the same options, every other op stays the eager ATen kernel, called from one wrapper
(C++ on the CPU, Python on CUDA): one call per step, still bit-identical to eager. If compiling
fails, the reason is kept (`compile_status`) and the eager function is used from then on;
ALTGRAD_NO_COMPILE=1 forces eager.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from functools import cache, wraps
from pathlib import Path
from typing import Any

import torch
import torch.fx.traceback as fx_traceback

from altgrad.quant import precompiled_headers
from altgrad.quant.formats import FormatSpec

Scale = float | torch.Tensor | None

MANTISSA_BITS = {torch.float32: 23, torch.float64: 52}

# The entries of `grid_params`.
CLAMP_LO = 0     # 2^(emin + P - mbits): |y| * 2^(P - mbits) is clamped to [CLAMP_LO, CLAMP_HI]
CLAMP_HI = 1     # 2^(max(emax, emin) + P - mbits) (E0 has one ULP everywhere)
TO_MAGIC = 2     # 2^(P - mbits)
MAX = 3          # the largest finite value
OVERFLOW = 4     # what overflow becomes: MAX when saturating or without specials, else inf or NaN
MIN_NORMAL = 5   # below it a flush-to-zero format's grid is {0, MIN_NORMAL} ...
FTZ_MAGIC = 6    # ... whose magic number this is
TO_FIELD = 7     # 2^(bias - P): maps an E?M0 magic number 2^(e + P) to 2^(e + bias), e + bias
                 # being the code's exponent field


def container_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel computes in: float64 stays float64 (no double rounding), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


Constants = torch.Tensor | tuple[torch.Tensor, ...]  # indexed by the named entries alike


def constants(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Constants:
    """`values` as a 1-d tensor, made once per values, dtype and device. Traced into a step graph,
    a tuple of 0-dim `full`s instead: literals that the kernel's compiled code inlines (a tensor made
    once would be an input of the graph, or a constant it copies, on every call; a stacked one, a
    buffer each fused loop writes and reads back)."""
    if torch.compiler.is_compiling():
        return tuple(torch.full((), v, dtype=dtype, device=device) for v in values)
    return _constants(values, dtype, device)


@cache
def _constants(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def format_constants(fn: Callable[..., tuple[float, ...]]) -> Callable[..., tuple[float, ...]]:
    """`fn`, a pure function of a format and other hashable settings to a tuple of floats, cached;
    and where dynamo traces a call, called as it is, its result a constant of the graph. Dynamo
    skips a cache and would otherwise trace the body, and every `FormatSpec` property it reads
    (each a Python function of the format's fields), again at each quantizer in every trace: most
    of a warm trial's start-up is dynamo's trace (docs/design.md). The result depends on the
    arguments alone, whose values dynamo guards on, so another format still compiles anew."""
    return torch.compiler.assume_constant_result(cache(fn))


@format_constants
def grid_values(fmt: FormatSpec, saturate: bool, mantissa_bits: int) -> tuple[float, ...]:
    """fmt's constants for a container of `mantissa_bits` (entries: CLAMP_LO ... TO_FIELD)."""
    shift = mantissa_bits - fmt.mbits
    overflow = fmt.max if saturate or fmt.specials == "none" else (
        math.inf if fmt.specials == "ieee" else math.nan)
    values = {CLAMP_LO: math.ldexp(1.0, fmt.emin + shift),
              CLAMP_HI: math.ldexp(1.0, max(fmt.emax, fmt.emin) + shift),
              TO_MAGIC: math.ldexp(1.0, shift), MAX: fmt.max, OVERFLOW: overflow,
              MIN_NORMAL: fmt.min_normal, FTZ_MAGIC: math.ldexp(1.0, fmt.emin + mantissa_bits),
              TO_FIELD: math.ldexp(1.0, fmt.bias - mantissa_bits)}
    return tuple(values[i] for i in range(len(values)))


def family(fmt: FormatSpec) -> tuple[bool, bool]:
    """(m0, ftz): the two traits of a format the kernels' code branches on (E?M0's tie fix-up, a
    flush-to-zero grid); every other trait is a value in `grid_params`. One compiled graph serves
    a family."""
    return fmt.mbits == 0, not fmt.subnormals


def grid_params(fmt: FormatSpec, saturate: bool, dtype: torch.dtype, device: torch.device) -> Constants:
    """fmt's constants as one tensor of the container dtype (entries: CLAMP_LO ... TO_FIELD)."""
    return constants(grid_values(fmt, saturate, MANTISSA_BITS[dtype]), dtype, device)


def magic(a: torch.Tensor, p: torch.Tensor, ftz: bool) -> torch.Tensor:
    """2^(e + P - mbits) for |y| = a (float32/64), e = floor(log2 a) clamped to the format."""
    s = torch.clamp(a * p[TO_MAGIC], p[CLAMP_LO], p[CLAMP_HI])
    c = s * (2.0 ** MANTISSA_BITS[a.dtype] + 1)
    hi = c - (c - s)  # s rounded to one significant bit: 2^E or 2^(E+1)
    m = torch.where(hi > s, hi * 0.5, hi)
    if ftz:  # below min_normal the grid is {0, min_normal}
        m = torch.where(a < p[MIN_NORMAL], p[FTZ_MAGIC], m)
    return m


def ulp(a: torch.Tensor, p: torch.Tensor, ftz: bool) -> torch.Tensor:
    """The format's ULP at |y| = a: 2^(e - mbits), the gap from a grid value to the next one away
    from zero (exact: the magic number scaled by a power of two)."""
    return magic(a, p, ftz) * 2.0 ** -MANTISSA_BITS[a.dtype]


def round_nearest(y: torch.Tensor, p: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    """y (float32/64) rounded to the nearest-even code, overflow handled, sign kept."""
    a = y.abs()
    mg = magic(a, p, ftz)
    q = (a + mg) - mg
    if m0:  # a tie a = 1.5 * 2^e went up to the even multiple 2^(e+1); the even *code* wins
        # instead: 2^e when its exponent field e + bias is even, i.e. 2^(e + bias) has an exact
        # square root. (mg = 2^(e + P); below min_normal a < 2^emin is never such a tie.)
        field = mg * p[TO_FIELD]
        root = torch.sqrt(field)
        tie = a == mg * (1.5 * 2.0 ** -MANTISSA_BITS[y.dtype])
        q = torch.where(tie & (root * root == field), q * 0.5, q)
    q = torch.where(q > p[MAX], p[OVERFLOW], q)
    return torch.copysign(q, y)


def nearest(x: torch.Tensor, p: torch.Tensor, m0: bool, ftz: bool) -> torch.Tensor:
    """x rounded to nearest-even, in x's dtype."""
    return round_nearest(x.to(container_dtype(x.dtype)), p, m0, ftz).to(x.dtype)


def unscale(q: torch.Tensor, scale: torch.Tensor, pow2: bool) -> torch.Tensor:
    """q / scale. With `pow2` (the caller knows scale is a power of two) it is q * (1 / scale): then
    1 / scale is exact and both are the correctly rounded q * 2^-k, equal bit for bit, while the
    elementwise division took about a fifth of a CPU quantizer call over a tensor that fits in
    cache (docs/design.md)."""
    return q * (1 / scale) if pow2 else q / scale


def nearest_scaled(x: torch.Tensor, scale: torch.Tensor, p: torch.Tensor, m0: bool,
                   ftz: bool, pow2: bool = False) -> torch.Tensor:
    """round_nearest(x * scale) / scale, in x's dtype (`pow2`: see `unscale`)."""
    return unscale(round_nearest(x.to(container_dtype(x.dtype)) * scale, p, m0, ftz), scale, pow2).to(x.dtype)


def stochastic(x: torch.Tensor, scale: torch.Tensor, p: torch.Tensor, ftz: bool,
               noise: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """floor(|x * scale| / ULP + noise) * ULP / scale with the sign kept, in x's dtype (`pow2`: see
    `unscale`)."""
    y = x.to(container_dtype(x.dtype)) * scale
    a = y.abs()
    step = ulp(a, p, ftz)
    q = torch.floor(a / step + noise) * step
    q = torch.where(q > p[MAX], p[OVERFLOW], q)
    return unscale(torch.copysign(q, y), scale, pow2).to(x.dtype)


@cache
def _one(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=dtype, device=device)


SCALE_RULE = "scale must be finite and > 0"


def _checked_scales(s: torch.Tensor) -> torch.Tensor:
    """s, one scale or a stack of them, if every one follows SCALE_RULE. On the CPU the host checks
    (ValueError naming the first bad one, one read of s); on an accelerator or inside a compiled
    graph an asynchronous device assert does, so the hot path never waits on the host."""
    if s.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = [v for v in s.reshape(-1).tolist() if not 0 < v < math.inf]  # NaN fails too
        if bad:
            raise ValueError(f"{SCALE_RULE}, got {bad[0]}")
    else:
        ok = (s > 0) & (s < math.inf)
        torch._assert_async(ok if s.dim() == 0 else ok.all(), f"altgrad quantize: {SCALE_RULE}")
    return s


def scale_tensor(scale: Scale, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Validate a scale and make it a 0-dim tensor of the compute dtype (None: 1): Python numbers
    here, tensors by `_checked_scales` (ValueError)."""
    if scale is None:
        return _one(dtype, device)
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError(f"scale must be a single float, got shape {tuple(scale.shape)} "
                             f"{scale.dtype}")
        return _checked_scales(scale.detach().reshape(()).to(device=device, dtype=dtype))
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a float or a tensor, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{SCALE_RULE}, got {scale}")
    return torch.full((), scale, dtype=dtype, device=device)


def scale_tensors(scales: Sequence[Scale], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`scale_tensor` of each of a non-empty list of scales, as one 1-d tensor of the compute dtype.

    Where they are all 0-dim float tensors on one device (the diagnostics pass each quantized
    layer's own scale, every diagnostic step), they are stacked and checked together: a few ops in
    all instead of a few per scale, each a dispatch from Python (on an accelerator, a launch)."""
    if not all(isinstance(s, torch.Tensor) and s.dim() == 0 and s.is_floating_point()
               and s.device == scales[0].device for s in scales):
        return torch.stack([scale_tensor(s, dtype, device) for s in scales])
    return _checked_scales(torch.stack(list(scales)).detach().to(device=device, dtype=dtype))


# -- compiling ---------------------------------------------------------------------------------

@cache
def compile_options() -> dict[str, object]:
    """Inductor options under which a compiled kernel computes exactly what eager does, op by op:
    no FP contraction (an FMA breaks the Veltkamp split; `emulate_precision_casts` turns off
    Triton's fp fusion), IEEE division (Triton's `/` is approximate), subnormals kept; plus no
    wrapper asserts of every input's size, stride and alignment per call (dynamo's guards checked
    them; with a few dozen inputs they cost ~0.1 ms a call), and no CUDA graphs whatever the
    environment says (TORCHINDUCTOR_CUDAGRAPHS=1): a replayed kernel's output is overwritten by its
    next call's (docs/design.md, "GPU runs"). Options this torch does not know are left out;
    tests/test_cuda.py checks the results bit for bit."""
    from torch._inductor import config

    wanted = {"cpp.enable_unsafe_math_opt_flag": False, "cpp.enable_floating_point_contract_flag": "off",
              "emulate_precision_casts": True, "eager_numerics.division_rounding": True,
              "eager_numerics.disable_ftz": True, "triton.cudagraphs": False,
              "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
    known = config.get_config_copy()
    return {k: v for k, v in wanted.items() if k in known}


GRAPHS_PER_KERNEL = 64  # a kernel's graphs: format family (m0, ftz) x dtype x rounding x input kind


_RAISED = threading.local()  # `graphs`: the limit this thread has raised dynamo's to


def allow_recompiles(graphs: int = GRAPHS_PER_KERNEL) -> None:
    """Let dynamo keep `graphs` graphs per function instead of its default 8, past which it stops
    compiling (dynamo has no per-function limit; it only grows). Dynamo keeps a setting per thread
    (a context variable), so every compiled call makes sure of it in its own thread: a kernel
    first called in one thread and recompiled in another (a Ray trial's) stopped at 8 there and ran
    eager from then on. Once raised, a thread-local read."""
    if getattr(_RAISED, "graphs", 0) >= graphs:
        return
    dynamo = torch._dynamo.config  # (named cache_size_limit before torch 2.6)
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), graphs))
    _RAISED.graphs = graphs


def _no_autocast(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off around a kernel: it computes in its own container dtype. (Autocast is also part
    of a graph's guards: called from forward, autocast on, and backward, off, each kernel would
    compile twice.)"""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def compiling_disabled() -> bool:
    return os.environ.get("ALTGRAD_NO_COMPILE") == "1"


def error_summary(err: Exception) -> str:
    """'<type>: <first line>' of a compiler error (a g++ error goes on with the command and its
    whole output)."""
    return f"{type(err).__name__}: {err}".splitlines()[0]


class Compiled:
    """A function compiled on first use, eager once compiling has failed (`compile_status`)."""

    registry: list[Compiled] = []  # every kernel and step graph, for `compile_status`

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None
        self.error: str | None = None
        Compiled.registry.append(self)

    def _fail(self, err: Exception, what: str) -> None:
        self.error = error_summary(err)
        warnings.warn(f"altgrad {what}: torch.compile failed, using eager ({self.error})",
                      RuntimeWarning, stacklevel=4)


# A kernel's intermediate that takes more ops than this is stored, not recomputed in each loop that
# reads it. In a step graph a format's constants are literals, not loads, so nothing else bounds
# how much inductor inlines: at its CPU default (50) one diagnostic step compiled for minutes.
STEP_REALIZE_OPS = 8
# A kernel's loop runs on several threads only when each gets at least this many elements. At
# inductor's CPU default (512) the quantizers of a small layer's tensors fork the OpenMP team for
# each of their loops, which costs more than the loop itself (docs/design.md).
STEP_MIN_CHUNK = 4096


def replays_cuda_graphs(device_type: str, cuda_graphs: bool) -> bool:
    """Whether a step graph on `device_type` is recorded as CUDA graphs and replayed: where the
    run asks for it (`train.cuda_graphs`) and the graph is on CUDA."""
    return cuda_graphs and device_type == "cuda"


def step_graph_options(device_type: str, cuda_graphs: bool = False) -> dict[str, Any]:
    """Inductor options of a `StepGraph` on `device_type`: "lite" mode (every op falls back to its
    ATen kernel but those marked `compile_with_inductor`: the kernels' ops, marked while traced,
    and what computes nothing, marked by `lower_what_computes_nothing`), the kernels'
    `compile_options` and the two bounds above, and on the CPU a C++ wrapper. The wrapper
    is what pays there: a step calls a few thousand ATen ops and a hundred fused kernels, and from
    Python each cost a few microseconds of interpreter (docs/design.md). Built separately from the
    kernels, the wrapper compiles at -O1: at -O3 one diagnostics graph took over ten minutes of g++.
    On CUDA the wrapper stays Python: there inductor's C++ wrapper did not build (docs/design.md,
    "GPU runs"), and a failed build is g++ time every trial would pay; with `cuda_graphs` inductor
    records the graph as a CUDA graph and replays it (`StepGraph`). compile_fx keeps the traced
    nodes' annotations through AOTAutograd only with provenance tracking on
    (`trace.provenance_tracking_level` 1; it adds comments and compile-time bookkeeping); without
    them every op would fall back. Buffer reuse, which lite mode turns off, is back on: the
    quantizers' loops write several hundred small buffers a step, each an allocation from the
    wrapper where a dead one would do (where a value is stored changes no value)."""
    from torch._inductor import list_mode_options

    options = {**list_mode_options("lite"), **compile_options(),
               "realize_opcount_threshold": STEP_REALIZE_OPS, "cpp.min_chunk_size": STEP_MIN_CHUNK,
               "allow_buffer_reuse": True, "trace.provenance_tracking_level": 1, "cpp_wrapper": True,
               "cpp_wrapper_build_separate": True}
    if device_type == "cpu":
        return options
    return {**python_wrapper(options), "triton.cudagraphs": replays_cuda_graphs(device_type, cuda_graphs)}


def python_wrapper(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with inductor's Python wrapper instead of the C++ one."""
    return {**options, "cpp_wrapper": False, "cpp_wrapper_build_separate": False}


LOWERED = "compile_with_inductor"  # the mark lite mode lowers a node for (the custom metadata's key)


def _lowered() -> contextlib.AbstractContextManager:
    """Marks the ops traced inside for inductor to lower in a step graph (lite mode); elsewhere
    the mark is ignored."""
    return fx_traceback.annotate({LOWERED: {}})


def computes_nothing(node: torch.fx.Node) -> bool:
    """A node of an AOTAutograd graph that moves no value through arithmetic: a view or alias
    with an inductor lowering (lowered, a reinterpretation of the same buffer: `detach`, `view`,
    `_unsafe_view`, `permute`, `select`, `split`, a dtype view); a `copy` of a value into a
    tensor of its dtype (what functionalization makes of a state's in-place write); or the `copy_`
    AOTAutograd appends to write a new value of the step's state back into its input buffer
    (lowered, the loop that computes the value writes it there)."""
    from torch._inductor.lowering import lowerings

    target, aten = node.target, torch.ops.aten
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target is aten.copy_.default:
        return node.args[0].op == "placeholder"
    if target is aten.copy.default:
        return node.args[0].meta["val"].dtype == node.args[1].meta["val"].dtype
    return (target.is_view or target is aten._unsafe_view.default) and target in lowerings


TRANSPOSES = (torch.ops.aten.t.default, torch.ops.aten.transpose.int)


def as_permute(node: torch.fx.Node) -> None:
    """Makes a `t` or `transpose` node the `permute` it is. Inductor lowers those two only by
    decomposing them into a `permute` while AOTAutograd traces, which lite mode does for the ops
    marked then, not for the transposes of a linear's backward."""
    x = node.args[0]
    n = x.meta["val"].dim()
    dims = list(range(n))
    if n >= 2:  # (`t` of a vector or a scalar is the tensor itself)
        d0, d1 = (0, 1) if node.target is torch.ops.aten.t.default else node.args[1:3]  # (negative: from the end)
        dims[d0], dims[d1] = dims[d1], dims[d0]
    node.target, node.args, node.kwargs = torch.ops.aten.permute.default, (x, dims), {}


def lower_what_computes_nothing(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's inner compile of a step graph, after marking the nodes that compute nothing
    (`computes_nothing`, transposes as the permutes they are) for lowering. Lite mode would call
    each through ATen from the wrapper: most of a step's calls, where lowered they are pointer
    arithmetic or a fused loop's write (docs/design.md). No value changes: the arithmetic stays
    ATen's or the kernels' own. (Not a pass of inductor's own: lite mode runs none.) A C++ wrapper
    compiled here gets the step graph wrapper's header (`wrapper_headers`); a graph from
    AOTAutograd's cache, which only loads, does not come here."""
    from torch._inductor.compile_fx import compile_fx_inner

    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in TRANSPOSES:
            as_permute(node)
        if computes_nothing(node):
            node.meta.setdefault("custom", {})[LOWERED] = {}
    gm.recompile()
    with precompiled_headers.wrapper_headers(compiling=True):
        return compile_fx_inner(gm, example_inputs, **kwargs)


@cache
def lowering_key() -> str:
    """A digest of this module, part of a step graph's keys in inductor's and AOTAutograd's caches
    (`cache_key_tag`). Both key a graph on what it traces and on inductor's options, not on what
    this module decides beside them -- the marks (node metadata: a graph traced with and without
    them is one key) and `lower_what_computes_nothing`, which runs after AOTAutograd's key is
    taken -- so a cache filled by another version of it would serve that version's lowering."""
    return "altgrad.quant.kernels:" + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


class Kernel(Compiled):
    """A kernel function, compiled on first use; eager when compiling is off or has failed.

    `Kernel(fn)(x, *args)` is `fn(x, *args)`. x (a tensor, or a non-empty list of them for one call
    over many) decides whether to compile (tensors of 0/1 elements are not) and which device's
    autocast to leave. Traced inside a `StepGraph`, the kernel is not a call of its own: its ops
    are marked for inductor to lower and fuse, with the same options, inside the step's graph.

    Compiled with dynamic shapes, so that the many sizes a quantizer meets share a graph. With
    `static_shapes`, for a kernel that meets one set of shapes per run (the manifold update, the
    diagnostics' kernels over a run's layers): then each call's guards are the C++ checks of its
    tensors, where symbolic sizes add a guard function in Python, and the loops' bounds are
    constants (docs/design.md)."""

    def __init__(self, fn: Callable[..., Any], static_shapes: bool = False):
        super().__init__(fn)
        self.static_shapes = static_shapes

    def __call__(self, x: torch.Tensor | list[torch.Tensor], *args) -> torch.Tensor:
        first = x[0] if isinstance(x, list) else x
        if torch.compiler.is_compiling():
            with _lowered(), _no_autocast(first):
                return self.fn(x, *args)
        # 0/1-element tensors would each specialise a new graph; they are not worth compiling.
        if self.error is None and (first is not x or x.numel() > 1) and not compiling_disabled():
            try:
                allow_recompiles()
                if self.compiled is None:
                    precompiled_headers.install()
                    self.compiled = torch.compile(self.fn, dynamic=not self.static_shapes, fullgraph=True,
                                                  options=compile_options())
                with _no_autocast(first):
                    return self.compiled(x, *args)
            except Exception as err:  # noqa: BLE001 - any compiler failure means: use eager
                if first.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    # (a recompile while a CUDA graph is recorded, say): the recording's failure,
                    # which `ReplayedCall` handles; the kernel compiled, and stays so
                    raise
                self._fail(err, "quantizer")
        return self.fn(x, *args)


# A step graph's variants: diagnostics on / off, times the emergency format shifts of a run (one
# layer each) and the models of one process (tests build many).
GRAPHS_PER_STEP = 64


class StepGraph(Compiled):
    """`fn` (the trainer's forward: a model's loss on a batch) compiled whole: dynamo traces it into
    one graph, AOTAutograd derives the backward graph, and inductor compiles both with
    `step_graph_options`: the kernels' ops lowered into fused loops, every other op the eager ATen
    kernel, all called from one wrapper per graph (C++ on the CPU, Python on CUDA). The result is
    bit-identical to eager -- inductor lowering the whole graph would re-associate the model's
    reductions and the quantizers' backward arithmetic -- while a step makes one compiled call
    instead of one per quantized tensor. Where the C++ wrapper fails to build, the graph gets the
    Python one; where inductor fails altogether, or a new graph fails in its first run (rolled back
    first), the step runs eager (`compile_status` says why).

    With `cuda_graphs`, on CUDA, inductor records the forward and the backward graph as CUDA
    graphs (its cudagraph trees: a graph's first call warms up, the second records) and replays
    them: a few launches instead of one per kernel. A replay's outputs live in the graphs' memory
    pool, which the next replay overwrites, so each call marks a new step: the caller must be done
    with the previous call's outputs -- the loss, and the gradients, which autograd takes from the
    backward graph as `.grad` without a copy (the trainer sets them to None every step). A
    recording that fails raises: it comes at a graph's second call, past the point the fallback can
    roll back to, and the backward's inside `loss.backward()` (tests/test_cuda.py records every
    kind of step graph the trainer makes). On any other device `step_graph_options` records
    nothing, so the option does nothing there (marking a step only advances a counter)."""

    def __init__(self, fn: Callable[..., Any], cuda_graphs: bool = False):
        super().__init__(fn)
        self.cuda_graphs = cuda_graphs
        self.graphs = 0  # graphs dynamo captured (diagnostics on / off, formats, models)
        self._ran = False  # compiled code has started to run in the current call
        self._rollback: Callable[[], None] | None = None  # undoes the current call's compiled code

    def replays_on(self, device: torch.device) -> bool:
        """Whether this step graph's calls on `device` are replayed CUDA graphs (unless compiling
        fails): where the work around it is worth replaying too (the trainer's diagnostics)."""
        return not compiling_disabled() and replays_cuda_graphs(device.type, self.cuda_graphs)

    def __call__(self, *args, **kwargs) -> Any:
        if self.error is None and not compiling_disabled():
            self._ran = False  # (`_rollback` is None between calls: `finally` below)
            try:
                allow_recompiles(GRAPHS_PER_STEP)
                if self.compiled is None:
                    self.compiled = self._compile()
                if self.cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                return self.compiled(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - any compiler failure means: use eager
                # Compiled code that failed while running may have changed what the step changes
                # (the generator it drew from; the buffers it writes, if it failed where the
                # functionalized writes land, at the graph's end): the eager step must not apply
                # that twice. A graph compiled in this call goes back to the state it started
                # from; one without a rollback point (it ran in an earlier call, or after a graph
                # break) raises its error as it is -- it may be the data's, a device assert.
                if self._ran:  # (else compiling failed: nothing ran)
                    if self._rollback is None:
                        err.add_note("altgrad step graph: raised by compiled code with no rollback point; the "
                                     "step's state may be partly updated, so it is not run again eagerly")
                        raise
                    self._rollback()
                self._fail(err, "step graph")
            finally:
                self._rollback = None  # (its copies)
        return self.fn(*args, **kwargs)

    def _entered(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """`run` (a compiled graph), noting in `_ran` that compiled code has started to run. A
        second graph of the same call (after a graph break) makes the rollback point stale: it
        restores the first graph's inputs only."""
        @wraps(run)
        def call(*args: Any) -> Any:
            if self._ran:
                self._rollback = None
            self._ran = True
            return run(*args)

        return call

    def _compile(self) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        # A cached function a step still traces (`_one`, the scale of an unscaled tensor) builds the
        # same constant in the graph, so dynamo's warning that it skips its cache says nothing a
        # user can act on (a format's constants are not traced: `format_constants`). Neither does
        # inductor's note that the C++ wrapper calls an ATen op through its generic dispatcher.
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
        logging.getLogger("torch._inductor.ir").addFilter(_no_shim_notes)

        def counted(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            self.graphs += 1
            # AOTAutograd does not cache a graph that calls an autograd.Function (the STE, the
            # grad_output quantizer) unless told to: it cannot know that its key, the dynamo
            # graph, holds what the Function computes. Here dynamo traced each Function's forward
            # and backward into that graph, so it does; cached, a later trial skips AOTAutograd's
            # trace of the joint graph (tests/test_compile_cache.py, docs/design.md).
            #
            # The backward graph is compiled now, not at the first backward (AOTAutograd's
            # default): a failure then surfaces here, where it can be handled, and not out of
            # `loss.backward()` -- and both graphs are looked up under this module's key.
            device_type = graph_device_type(example_inputs)
            # Compiled before it first runs: the state it will start from, unless a graph of this
            # call ran already (a graph break), which made the state no longer the call's own.
            self._rollback = None if self._ran else rollback_point(example_inputs, device_type)
            options = step_graph_options(device_type, self.cuda_graphs)
            key_tag = torch.compiler.config.cache_key_tag + lowering_key()  # (a user's own tag kept)
            with (torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=True,
                                                force_non_lazy_backward_lowering=True),
                  torch.compiler.config.patch(cache_key_tag=key_tag), precompiled_headers.wrapper_headers(compiling=False)):
                try:
                    return self._entered(compile_fx(gm, example_inputs, lower_what_computes_nothing, options))
                except Exception as err:
                    if not options["cpp_wrapper"]:
                        raise
                    # Inductor's C++ wrapper does not build every op it calls (docs/design.md,
                    # "GPU runs"); the Python wrapper calls the same kernels and ops, paying
                    # Python's few microseconds per op, and is still one call a step.
                    warnings.warn(f"altgrad step graph: inductor's C++ wrapper failed "
                                  f"({error_summary(err)}), using its Python wrapper",
                                  RuntimeWarning, stacklevel=2)
                    return self._entered(compile_fx(gm, example_inputs, lower_what_computes_nothing,
                                                     python_wrapper(options)))

        # Static shapes: a step's shapes never change, and inductor fails on symbolic ones here.
        return torch.compile(self.fn, backend=counted, dynamic=False)


def rollback_point(example_inputs: list[Any], device_type: str) -> Callable[[], None]:
    """A function that puts back what a graph's inputs hold now, and the state of the CPU's and
    `device_type`'s generators (the graph may draw random numbers). The inputs copied are those
    that do not require grad: the buffers a step writes, and the batch. Not the weights, which a
    training forward does not write. Taken once per graph, when it is compiled: not a cost of
    every step."""
    saved = [(t, t.detach().clone()) for t in example_inputs
             if isinstance(t, torch.Tensor) and not t.requires_grad]
    rng = torch.get_rng_state()
    accelerator = getattr(torch, device_type, None) if device_type != "cpu" else None
    get_all = getattr(accelerator, "get_rng_state_all", None)
    accelerator_rng = get_all() if get_all is not None else None

    @torch.no_grad()
    def rollback() -> None:
        for t, value in saved:
            t.copy_(value)
        torch.set_rng_state(rng)
        if accelerator_rng is not None:
            accelerator.set_rng_state_all(accelerator_rng)

    return rollback


def graph_device_type(example_inputs: list[Any]) -> str:
    """The device a graph computes on: "cpu" if every tensor input (the model's parameters are
    inputs too) is on the CPU, else the accelerator's type. A CPU scalar beside CUDA tensors does
    not make a graph a CPU one."""
    accelerators = sorted({x.device.type for x in example_inputs if isinstance(x, torch.Tensor)} - {"cpu"})
    return accelerators[0] if accelerators else "cpu"


def _no_shim_notes(record: logging.LogRecord) -> bool:
    return "missing a c-shim implementation" not in record.getMessage()


def compile_status() -> str:
    """'compiled', 'eager (ALTGRAD_NO_COMPILE=1)' or 'eager (<why compiling failed>)'."""
    if compiling_disabled():
        return "eager (ALTGRAD_NO_COMPILE=1)"
    errors = [k.error for k in Compiled.registry if k.error]
    return f"eager ({errors[0]})" if errors else "compiled"
