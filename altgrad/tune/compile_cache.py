"""A sweep's compile cache: inductor's cache directory, kept with the experiment.

Every trial is a fresh process that compiles its step graph and kernels before its first step.
Inductor keeps what it compiled in a cache directory (TORCHINDUCTOR_CACHE_DIR; by default under
/tmp, per machine), so a later trial on the same machine skips the code generation -- but a trial
on another node does not, nor any trial on the machine that replaces a killed spot instance. So
the experiment keeps the directory, `<experiment>/compile_cache/`: on local (or mounted, shared)
storage every trial uses it in place; on remote storage a trial fetches it into a directory of its
node before it compiles and copies it back if it compiled anything the cache lacked. (torch's
portable cache artifacts, `torch.compiler.save_cache_artifacts`, do not hold the regions of a
step graph: they come back empty.) What it saves: `benchmarks/warm_trial.py`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from pyarrow.fs import FileSystem, FileType, LocalFileSystem, copy_files

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compiled_anything_new() -> bool:
    """Whether this process compiled a graph its cache did not hold (a kernel: inductor's FX graph
    cache; a step graph's region: AOTAutograd's cache)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"] > 0


def node_directory(fs: FileSystem, directory: str) -> str:
    """Where this process keeps the cache of `directory` on `fs`: the directory itself on local
    storage, else one directory per experiment under this node's temp dir."""
    if fs.type_name == "local":
        return directory
    digest = hashlib.sha256(f"{fs.type_name}:{directory}".encode()).hexdigest()[:16]
    return str(Path(tempfile.gettempdir()) / "altgrad-compile-cache" / digest)


def use(fs: FileSystem, directory: str) -> int:
    """Make `directory` on `fs` this process's inductor cache (before anything compiles): fetched to
    `node_directory` when remote. Returns how many cached files it then holds."""
    local = node_directory(fs, directory)
    Path(local).mkdir(parents=True, exist_ok=True)
    if local != directory and fs.get_file_info(directory).type == FileType.Directory:
        copy_files(directory, local, source_filesystem=fs, destination_filesystem=LocalFileSystem())
    os.environ[CACHE_ENV] = local
    return sum(len(files) for _, _, files in os.walk(local))


def publish(fs: FileSystem, directory: str) -> bool:
    """Copy this process's cache back to `directory` on remote storage if it compiled anything the
    cache lacked; whether it copied. (On local storage the trial wrote there already.)"""
    local = node_directory(fs, directory)
    if local == directory or not compiled_anything_new():
        return False
    fs.create_dir(directory, recursive=True)
    copy_files(local, directory, source_filesystem=LocalFileSystem(), destination_filesystem=fs)
    return True
