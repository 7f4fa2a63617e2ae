"""A sweep's compile cache: the step graphs and kernels its trials compiled, kept with the experiment.

Every trial is a fresh process that compiles its step graph and kernels before its first step. On
one machine inductor's on-disk cache (under /tmp by default) spares a later trial the code
generation, but not a trial on another node, nor any trial on the machine that replaces a killed
spot instance. So a trial that compiled something its caches did not hold saves torch's portable
cache artifacts (`torch.compiler.save_cache_artifacts`) as `<experiment>/compile_cache/<key>.bin`
on the experiment's storage, and every trial loads all of them before it builds its model: a
trial whose graphs an earlier trial compiled (same format family, model and shapes) skips their
code generation wherever it runs. What that saves is measured by `benchmarks/warm_trial.py`.
"""

from __future__ import annotations

import logging

import torch
from pyarrow.fs import FileSelector, FileSystem, FileType

log = logging.getLogger("altgrad.tune.trial")

SUFFIX = ".bin"


def compiled_anything_new() -> bool:
    """Whether this process generated code its caches did not hold (an inductor cache miss)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] > 0


def load(fs: FileSystem, directory: str) -> int:
    """Load every artifact file in `directory` into this process's compile caches; how many it
    loaded. A file that cannot be read or loaded (a partial upload, another torch version) is
    skipped with a warning: a cache can only save time, never fail a trial."""
    loaded = 0
    for info in fs.get_file_info(FileSelector(directory, allow_not_found=True)):
        if info.type != FileType.File or not info.path.endswith(SUFFIX):
            continue
        try:
            with fs.open_input_stream(info.path) as f:
                # None: torch found the bytes corrupt (it logs why) and loaded nothing
                loaded_now = torch.compiler.load_cache_artifacts(f.read()) is not None
            why = "not cache artifacts of this torch"
        except Exception as err:  # noqa: BLE001 - any failure means: compile as without a cache
            loaded_now, why = False, f"{type(err).__name__}: {err}"
        if loaded_now:
            loaded += 1
        else:
            log.warning("compile cache: skipped %s (%s)", info.path, why)
    return loaded


def save(fs: FileSystem, directory: str, name: str) -> bool:
    """Save this process's cache artifacts as `directory/name.bin` if it compiled anything new;
    whether it saved. Written under a temporary name and moved into place, so a reader never loads
    a partial file."""
    if not compiled_anything_new():
        return False
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return False
    fs.create_dir(directory, recursive=True)
    partial = f"{directory}/{name}{SUFFIX}.partial"
    with fs.open_output_stream(partial) as f:
        f.write(artifacts[0])
    fs.move(partial, f"{directory}/{name}{SUFFIX}")
    return True
