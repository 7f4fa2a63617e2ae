"""The headers of a step graph's C++ wrapper, precompiled as one.

On the CPU a step graph's wrapper is C++ (`kernels.step_graph_options`), and g++ compiles one for
every graph inductor compiles. Inductor builds it against a precompiled header that holds
`torch/csrc/inductor/cpp_wrapper/cpu.h` alone. But a wrapper that calls an ATen op through the boxed
dispatcher (layer norm, GELU, arange: schemas with a list, a string or an optional dtype, which the
stable ABI cannot carry) also includes the dispatcher's, IValue's and the JIT types' headers. Every
step graph calls such ops, and g++ parsed those headers anew for each one: about half of a wrapper's
compile time (docs/design.md, "The step graph wrapper's headers"). `precompiled_wrapper_headers`
has inductor precompile `step_graph_wrapper.h` in its place: its own header first, then the rest.
What the wrapper compiles to is the same code; only the parsing moves into the precompiled header.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

# Resolved: the precompiled header is keyed on this path, so a package whose modules link here
# (a test's altered copy) shares it.
WRAPPER_HEADER = Path(__file__).resolve().with_name("step_graph_wrapper.h")


def wrapper_includes(source: str) -> list[str]:
    """The headers `source` (C++) includes with `#include <...>`, in order."""
    return re.findall(r"^\s*#include\s*<([^>]+)>", source, flags=re.MULTILINE)


@contextlib.contextmanager
def precompiled_wrapper_headers() -> Iterator[None]:
    """While inside, inductor precompiles `WRAPPER_HEADER` for a CPU graph's C++ wrapper instead of
    its own header, which `WRAPPER_HEADER` includes first. Where this torch precompiles another
    header (or none, or has no such hook), nothing changes: a wrapper compiled against a header
    that lacks what it needs would still build, only slower, but one against a different base
    header might not."""
    try:
        from torch._inductor.codecache import CppWrapperCodeCache
    except ImportError:
        yield
        return
    original = CppWrapperCodeCache.__dict__.get("_get_uncompiled_header")
    if not isinstance(original, classmethod):
        yield
        return
    base = wrapper_includes(WRAPPER_HEADER.read_text())[0]

    def header(cls: type, device: str) -> str | None:
        own = original.__func__(cls, device)
        return str(WRAPPER_HEADER) if own == base else own

    CppWrapperCodeCache._get_uncompiled_header = classmethod(header)
    try:
        yield
    finally:
        CppWrapperCodeCache._get_uncompiled_header = original
