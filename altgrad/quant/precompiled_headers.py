"""Inductor's precompiled headers, as altgrad's compiles have them built: the step graph wrapper's
headers as one, none where a graph is only loaded, and each header built once per machine.

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

Inductor keys a precompiled header on the command line of the file that includes it, and that
differs between a file compiled alone (`-c`: a wrapper whose graph has fused kernels, and those
kernels) and one compiled and linked in one go (`-shared`: a wrapper of ATen calls alone, such as a
bf16 step graph's, and a kernel compiled on its own). The header itself is built by the same g++
command either way, so a machine built each of its headers twice, one the other's copy
(docs/design.md, "Each precompiled header keyed on the command that builds it"). Keyed on that
command, each is built once.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from functools import cache
from pathlib import Path
from typing import Any

# Resolved: the precompiled header is keyed on this path, so a package whose modules link here
# (a test's altered copy) shares it.
WRAPPER_HEADER = Path(__file__).resolve().with_name("step_graph_wrapper.h")

_compiling: ContextVar[bool | None] = ContextVar("altgrad_wrapper_compiling", default=None)


def wrapper_includes(source: str) -> list[str]:
    """The headers `source` (C++) includes with `#include <...>`, in order."""
    return re.findall(r"^\s*#include\s*<([^>]+)>", source, flags=re.MULTILINE)


@cache
def install() -> bool:
    """Routes inductor's choice of a CPU wrapper's header through `wrapper_headers`, and keys each
    precompiled header on the command that builds it; once per process, before anything compiles.
    Where this torch lacks either hook, that one changes nothing. Whether both are in place."""
    choice, key = _header_choice_hooked(), _header_key_hooked()
    return choice and key


def _header_choice_hooked() -> bool:
    """Outside `wrapper_headers` inductor's choice stands. Where inductor precompiles another base
    header (a wrapper built against a different one might not build), it stands too."""
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


def _header_key_hooked() -> bool:
    """Inductor's `_precompile_header(header, key, **compile_command)` builds `header` with
    `compile_command` (less its link inputs) and `precompiling`, under a name hashed from `key`,
    the header's preprocessed text and the compiler's version; `key` is the including file's
    command line. Here it is the building command's own."""
    try:
        from torch._inductor import codecache, cpp_builder
    except ImportError:
        return False
    inductors: Callable[..., str] | None = getattr(codecache, "_precompile_header", None)
    if inductors is None:
        return False

    def precompile_header(header: str, including_command: str, **compile_command: Any) -> str:
        build = {name: value for name, value in compile_command.items() if name != "extra_flags"}
        try:
            key = cpp_builder.CppBuilder(name="o", sources="i", BuildOption=cpp_builder.CppTorchDeviceOptions(
                **build, precompiling=True)).get_command_line()
        except TypeError:  # options this torch's builder does not take: inductor's own key
            key = including_command
        return inductors(header, key, **compile_command)

    codecache._precompile_header = precompile_header
    return True


@contextlib.contextmanager
def wrapper_headers(compiling: bool) -> Iterator[None]:
    """While inside, a CPU wrapper inductor builds or loads gets `WRAPPER_HEADER` precompiled if
    `compiling`, else no precompiled header. The innermost of nested ones decides."""
    install()
    token = _compiling.set(compiling)
    try:
        yield
    finally:
        _compiling.reset(token)
