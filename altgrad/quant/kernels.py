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
a step graph, whose regions are compiled per layer anyway, the same entries are literals instead
(`constants`).

`Kernel` compiles a function lazily with `torch.compile(dynamic=True)`: one compiled call per
quantized tensor. `StepGraph` compiles a whole model forward (and, through AOTAutograd, its
backward) as one graph instead, in which every kernel the forward calls is an inductor *region*
compiled with the same options, and every other op stays the eager ATen op: one call per step, and
still bit-identical to eager. If compiling fails, the reason is kept (`compile_status`) and the
eager function is used from then on; ALTGRAD_NO_COMPILE=1 forces eager.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.fx.traceback as fx_traceback

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
    buffer each region writes and reads back)."""
    if torch.compiler.is_compiling():
        return tuple(torch.full((), v, dtype=dtype, device=device) for v in values)
    return _constants(values, dtype, device)


@cache
def _constants(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


@cache
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


def nearest_scaled(x: torch.Tensor, scale: torch.Tensor, p: torch.Tensor, m0: bool,
                   ftz: bool) -> torch.Tensor:
    """round_nearest(x * scale) / scale, in x's dtype."""
    return (round_nearest(x.to(container_dtype(x.dtype)) * scale, p, m0, ftz) / scale).to(x.dtype)


def stochastic(x: torch.Tensor, scale: torch.Tensor, p: torch.Tensor, ftz: bool,
               noise: torch.Tensor) -> torch.Tensor:
    """floor(|x * scale| / ULP + noise) * ULP / scale with the sign kept, in x's dtype."""
    y = x.to(container_dtype(x.dtype)) * scale
    a = y.abs()
    step = ulp(a, p, ftz)
    q = torch.floor(a / step + noise) * step
    q = torch.where(q > p[MAX], p[OVERFLOW], q)
    return (torch.copysign(q, y) / scale).to(x.dtype)


@cache
def _one(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=dtype, device=device)


def scale_tensor(scale: Scale, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Validate a scale and make it a 0-dim tensor of the compute dtype (None: 1).

    Python numbers and CPU tensors are checked here (ValueError). A scale on an accelerator is
    checked with an asynchronous device assert instead, so the hot path never waits on the host.
    """
    if scale is None:
        return _one(dtype, device)
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError(f"scale must be a single float, got shape {tuple(scale.shape)} "
                             f"{scale.dtype}")
        s = scale.detach().reshape(()).to(device=device, dtype=dtype)
        if s.device.type == "cpu" and not torch.compiler.is_compiling():
            if not 0 < s.item() < math.inf:  # NaN fails too
                raise ValueError(f"scale must be finite and > 0, got {s.item()}")
        else:
            torch._assert_async((s > 0) & (s < math.inf), "altgrad quantize: scale must be finite and > 0")
        return s
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a float or a tensor, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return torch.full((), scale, dtype=dtype, device=device)


# -- compiling ---------------------------------------------------------------------------------

@cache
def compile_options() -> dict[str, object]:
    """Inductor options under which a compiled kernel computes exactly what eager does, op by op:
    no FP contraction (an FMA breaks the Veltkamp split; `emulate_precision_casts` turns off
    Triton's fp fusion), IEEE division (Triton's `/` is approximate), subnormals kept; plus no
    wrapper asserts of every input's size, stride and alignment per call (dynamo's guards checked
    them; with a few dozen inputs they cost ~0.1 ms a call). Options this torch does not know are
    left out; tests/test_cuda.py checks the results bit for bit."""
    from torch._inductor import config

    wanted = {"cpp.enable_unsafe_math_opt_flag": False, "cpp.enable_floating_point_contract_flag": "off",
              "emulate_precision_casts": True, "eager_numerics.division_rounding": True,
              "eager_numerics.disable_ftz": True,
              "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
    known = config.get_config_copy()
    return {k: v for k, v in wanted.items() if k in known}


GRAPHS_PER_KERNEL = 64  # a kernel's graphs: format family (m0, ftz) x dtype x rounding x input kind


def allow_recompiles(graphs: int = GRAPHS_PER_KERNEL) -> None:
    """Let dynamo keep `graphs` graphs per function instead of its default 8, past which it stops
    compiling. The limit is process-wide (dynamo has no per-function one); it only grows."""
    dynamo = torch._dynamo.config  # (named cache_size_limit before torch 2.6)
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), graphs))


def _no_autocast(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off around a kernel: it computes in its own container dtype. (Autocast is also part
    of a graph's guards: called from forward, autocast on, and backward, off, each kernel would
    compile twice.)"""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def compiling_disabled() -> bool:
    return os.environ.get("ALTGRAD_NO_COMPILE") == "1"


class Compiled:
    """A function compiled on first use, eager once compiling has failed (`compile_status`)."""

    registry: list[Compiled] = []  # every kernel and step graph, for `compile_status`

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None
        self.error: str | None = None
        Compiled.registry.append(self)

    def _fail(self, err: Exception, what: str) -> None:
        self.error = f"{type(err).__name__}: {err}".splitlines()[0]
        warnings.warn(f"altgrad {what}: torch.compile failed, using eager ({self.error})",
                      RuntimeWarning, stacklevel=4)


# A region's intermediate that takes more ops than this is stored, not recomputed in each loop that
# reads it. In a step graph a format's constants are literals, not loads, so nothing else bounds
# how much inductor inlines: at its CPU default (50) one diagnostic region compiled for minutes.
REGION_REALIZE_OPS = 8
# A region's loop runs on several threads only when each gets at least this many elements. At
# inductor's CPU default (512) the quantizers of a small layer's tensors fork the OpenMP team for
# each of their loops, which costs more than the loop itself (docs/design.md).
REGION_MIN_CHUNK = 4096

# Set by the first StepGraph: the inductor options of a kernel's region in a step graph. Read
# outside any trace (reading inductor's config inside one breaks the graph).
_REGION_OPTIONS: dict[str, Any] | None = None


def _region(name: str | None) -> contextlib.AbstractContextManager:
    """Marks what is traced inside as an inductor region of the step graph (`regional_inductor`),
    named `name` if given. Outside a step graph (no `_REGION_OPTIONS`): nothing to mark."""
    if _REGION_OPTIONS is None:
        return contextlib.nullcontext()
    marking: dict[str, Any] = {"inductor_configs": _REGION_OPTIONS}
    if name is not None:
        marking["inductor_region"] = name
    return fx_traceback.annotate({"compile_with_inductor": marking})


class Kernel(Compiled):
    """A kernel function, compiled on first use; eager when compiling is off or has failed.

    `Kernel(fn)(x, *args)` is `fn(x, *args)`. x (a tensor, or a non-empty list of them for one call
    over many) decides whether to compile (tensors of 0/1 elements are not) and which device's
    autocast to leave. Traced inside a `StepGraph`, the kernel is not a call of its own but a region
    of the step's graph, compiled by inductor with the same options. Calls under one `region` name
    (a layer's, for its quantizers) make one region of their own; unnamed calls share one pool, from
    which the partitioner may gather one layer's state updates into a later layer's region, each
    intermediate they need becoming an output of the region it was computed in (docs/design.md)."""

    def __call__(self, x: torch.Tensor | list[torch.Tensor], *args, region: str | None = None) -> torch.Tensor:
        first = x[0] if isinstance(x, list) else x
        if torch.compiler.is_compiling():
            with _region(region), _no_autocast(first):
                return self.fn(x, *args)
        # 0/1-element tensors would each specialise a new graph; they are not worth compiling.
        if self.error is None and (first is not x or x.numel() > 1) and not compiling_disabled():
            try:
                if self.compiled is None:
                    allow_recompiles()
                    self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True,
                                                  options=compile_options())
                with _no_autocast(first):
                    return self.compiled(x, *args)
            except Exception as err:  # noqa: BLE001 - any compiler failure means: use eager
                self._fail(err, "quantizer")
        return self.fn(x, *args)


# A step graph's variants: diagnostics on / off, times the emergency format shifts of a run (one
# layer each) and the models of one process (tests build many).
GRAPHS_PER_STEP = 64


class StepGraph(Compiled):
    """`fn` (a model's forward) compiled whole: dynamo traces it into one graph, AOTAutograd derives
    the backward graph, and `regional_inductor` compiles only the kernels' regions in both (with
    `compile_options`), running every other op as the eager ATen op. The result is bit-identical to
    eager -- inductor lowering the whole graph re-associates the quantizers' backward arithmetic --
    while a step makes one compiled call instead of one per quantized tensor."""

    def __init__(self, fn: Callable[..., Any]):
        super().__init__(fn)
        self.graphs = 0  # graphs dynamo captured (diagnostics on / off, formats, models)

    def __call__(self, *args, **kwargs) -> Any:
        if self.error is None and not compiling_disabled():
            try:
                if self.compiled is None:
                    self.compiled = self._compile()
                return self.compiled(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - any compiler failure means: use eager
                self._fail(err, "step graph")
        return self.fn(*args, **kwargs)

    def _compile(self) -> Callable[..., Any]:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch.fx.passes.regional_inductor import regional_inductor

        global _REGION_OPTIONS
        _REGION_OPTIONS = {**compile_options(), "realize_opcount_threshold": REGION_REALIZE_OPS,
                           "cpp.min_chunk_size": REGION_MIN_CHUNK}
        allow_recompiles(GRAPHS_PER_STEP)
        # The cached functions a step calls (`grid_params`, `scaler_params`) turn a format's fields
        # into a small tensor; traced, they build the same constants in the graph, so dynamo's
        # warning that it skips their cache says nothing a user can act on.
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")

        def regions(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            drop_identity_ops(gm)
            compiled = regional_inductor(gm, example_inputs)  # boxed (takes a list) only if it found regions
            return compiled if getattr(compiled, "_boxed_call", False) else make_boxed_func(compiled)

        backend = aot_autograd(fw_compiler=regions, bw_compiler=regions)

        def counted(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            self.graphs += 1
            return backend(gm, example_inputs)

        # Static shapes: a step's shapes never change, and inductor fails on symbolic ones here.
        return torch.compile(self.fn, backend=counted, dynamic=False)


RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def drop_identity_ops(gm: torch.fx.GraphModule) -> None:
    """Remove the ops of an AOTAutograd graph that only rename a value, and shorten reshape chains.

    Outside the regions each node is an eager op of its own, a dispatch from Python, and tracing
    leaves many that compute nothing (docs/design.md):
    - `detach`: the graph runs without autograd;
    - `copy(dst, src)` of a fresh tensor src laid out like dst: how a buffer's in-place update is
      written functionally (the runtime copies the graph's output into the buffer anyway);
    - `clone` of a fresh tensor or of a view of one, laid out alike, at the same storage offset
      (dropout at p=0);
    - a reshape (`view`, `_unsafe_view`) to its input's own shape, such as each kernel's result
      reshaped back to the shape it already has.
    A reshape of a reshape of a contiguous tensor that is not a no-op reshapes that tensor directly
    (the same view of the same storage, so also where it is a graph output). A buffer update's copy
    is usually a graph output, and its fresh source takes its place there; every other op whose
    result is a graph output stays, since an output must not become the graph's input, nor change
    what it aliases."""
    graph = gm.graph
    output = graph.output_node()
    for node in list(graph.nodes):
        is_output = output in node.users
        if node.target in RESHAPES:
            source = node.args[0]
            if (not _same_layout(node, source) and getattr(source, "target", None) in RESHAPES
                    and _contiguous(source.args[0])):
                node.args = (source.args[0], *node.args[1:])  # skip the first reshape
                if not source.users:
                    graph.erase_node(source)
                source = node.args[0]
            drop = not is_output and _same_layout(node, source)
        elif node.target is torch.ops.aten.copy.default and len(node.args) == 2 and not node.kwargs:
            target, source = node.args
            drop = _fresh(source) and len(source.users) == 1 and _same_layout(target, source)
        elif node.target is torch.ops.aten.detach.default:
            source, drop = node.args[0], not is_output
        elif node.target is torch.ops.aten.clone.default and not node.kwargs:
            source = node.args[0]
            drop = not is_output and _fresh(_base(source)) and _same_layout(node, source)
        else:
            continue
        if drop:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _fresh(node: Any) -> bool:
    """node is computed in the graph by an op that returns a new tensor (not an input, not a view)."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload) and not node.target.is_view)


def _base(node: Any) -> Any:
    """The node that computes the storage node's tensor is a view of (through any chain of views);
    node itself if it is not a view."""
    while (isinstance(node, torch.fx.Node) and isinstance(node.target, torch._ops.OpOverload)
           and node.target.is_view):
        node = node.args[0]
    return node


def _contiguous(node: Any) -> bool:
    """node's tensor (from tracing) is contiguous: then any reshape of it is a view of it."""
    value = getattr(node, "meta", {}).get("val")
    return isinstance(value, torch.Tensor) and value.is_contiguous()


def _same_layout(a: Any, b: Any) -> bool:
    """Both nodes' tensors have the same shape, strides, storage offset, dtype and device (from
    tracing): an op that reads the storage (`as_strided`) finds the same elements in either."""
    va, vb = (getattr(n, "meta", {}).get("val") for n in (a, b))
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.stride() == vb.stride() and va.storage_offset() == vb.storage_offset()
            and va.dtype == vb.dtype and va.device == vb.device)


def compile_status() -> str:
    """'compiled', 'eager (ALTGRAD_NO_COMPILE=1)' or 'eager (<why compiling failed>)'."""
    if compiling_disabled():
        return "eager (ALTGRAD_NO_COMPILE=1)"
    errors = [k.error for k in Compiled.registry if k.error]
    return f"eager ({errors[0]})" if errors else "compiled"
