"""The headers of a step graph's C++ wrapper, precompiled as one where it is compiled, and not at
all where it is only loaded.

On the CPU a step graph's wrapper is C++ (`kernels.step_graph_options`), and g++ compiles one for
every graph inductor compiles. Inductor builds it against a precompiled header that holds
`torch/csrc/inductor/cpp_wrapper/cpu.h` alone. But a wrapper that calls an ATen op through the boxed
dispatcher (layer norm, GELU, arange: schemas with a list, a string or an optional dtype, which the
stable ABI cannot carry) also includes the dispatcher's, IValue's and the JIT types' headers. Every
step graph calls such ops, and g++ parsed those headers anew for each one: about half of a wrapper's
compile time (docs/design.md, "The step graph wrapper's headers"). So where a graph is compiled,
inductor precompiles `step_graph_wrapper.h` instead: its own header first, then the rest; the code
compiled is the same. And inductor precompiles the header at every load of a wrapper, a cached one
too, where nothing is compiled: a warm trial on a new node paid that build for nothing, so where a
graph is only loaded, no header is precompiled.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from contextvars import ContextVar
from functools import cache
from pathlib import Path

# Resolved: the precompiled header is keyed on this path, so a package whose modules link here
# (a test's altered copy) shares it.
WRAPPER_HEADER = Path(__file__).resolve().with_name("step_graph_wrapper.h")

_compiling: ContextVar[bool | None] = ContextVar("altgrad_wrapper_compiling", default=None)


def wrapper_includes(source: str) -> list[str]:
    """The headers `source` (C++) includes with `#include <...>`, in order."""
    return re.findall(r"^\s*#include\s*<([^>]+)>", source, flags=re.MULTILINE)


@cache
def _hooked() -> bool:
    """Routes inductor's choice of a CPU wrapper's header through `_compiling`, once per process.
    Outside `wrapper_headers` inductor's choice stands. Where this torch has no such hook, or
    precompiles another base header (a wrapper built against a different one might not build),
    nothing changes."""
    try:
        from torch._inductor.codecache import CppWrapperCodeCache
    except ImportError:
        return False
    inductors = CppWrapperCodeCache.__dict__.get("_get_uncompiled_header")
    if not isinstance(inductors, classmethod):
        return False
    base = wrapper_includes(WRAPPER_HEADER.read_text())[0]

    def header(cls: type, device: str) -> str | None:
        own, compiling = inductors.__func__(cls, device), _compiling.get()
        if compiling is None or own != base:
            return own
        return str(WRAPPER_HEADER) if compiling else None

    CppWrapperCodeCache._get_uncompiled_header = classmethod(header)
    return True


@contextlib.contextmanager
def wrapper_headers(compiling: bool) -> Iterator[None]:
    """While inside, a CPU wrapper inductor builds or loads gets `WRAPPER_HEADER` precompiled if
    `compiling`, else no precompiled header. The innermost of nested ones decides."""
    _hooked()
    token = _compiling.set(compiling)
    try:
        yield
    finally:
        _compiling.reset(token)
