"""A sweep's compile cache: inductor's cache directory, kept with the experiment.

Every trial is a fresh process that compiles its step graph and kernels before its first step.
Inductor keeps what it compiled in a cache directory (TORCHINDUCTOR_CACHE_DIR; by default under
/tmp, per machine), so a later trial on the same machine skips the code generation -- but a trial
on another node does not, nor any trial on the machine that replaces a killed spot instance. So
the experiment keeps the directory, `<experiment>/compile_cache/`: on local (or mounted, shared)
storage every trial uses it in place; on remote storage a trial fetches it into a directory of its
node before it compiles and copies it back if it compiled anything the cache lacked. (torch's
portable cache artifacts, `torch.compiler.save_cache_artifacts`, came back empty for a step
graph.) What it saves: `benchmarks/warm_trial.py`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from pyarrow.fs import FileSystem, FileType, LocalFileSystem, copy_files

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_misses() -> int:
    """Graphs this process compiled that its cache did not hold (inductor's FX graph cache, and
    AOTAutograd's for a step graph)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]


def node_directory(fs: FileSystem, directory: str) -> str:
    """Where a process keeps the cache of `directory` on `fs`: the directory itself on local
    storage, else one directory per experiment under this node's temp dir."""
    if fs.type_name == "local":
        return directory
    digest = hashlib.sha256(f"{fs.type_name}:{directory}".encode()).hexdigest()[:16]
    return str(Path(tempfile.gettempdir()) / "altgrad-compile-cache" / digest)


class CompileCache:
    """The experiment's compile cache `directory` on `fs`, as one trial process uses it."""

    def __init__(self, fs: FileSystem, directory: str):
        self.fs, self.directory = fs, directory
        self.local = node_directory(fs, directory)
        self._published = 0  # compile misses already copied back

    def use(self) -> int:
        """Make the cache this process's inductor cache (before anything compiles), fetched to the
        node first when remote. Returns how many cached files it then holds."""
        Path(self.local).mkdir(parents=True, exist_ok=True)
        if self.local != self.directory and self.fs.get_file_info(self.directory).type == FileType.Directory:
            copy_files(self.directory, self.local, source_filesystem=self.fs,
                       destination_filesystem=LocalFileSystem())
        os.environ[CACHE_ENV] = self.local
        return sum(len(files) for _, _, files in os.walk(self.local))

    def publish(self) -> bool:
        """Copy the node's cache back to remote storage if this process compiled anything since it
        last did; whether it copied. (On local storage the process wrote there already.) A trial
        publishes at its first report, before Tune may stop it, and again at its end."""
        misses = compile_misses()
        if self.local == self.directory or misses == self._published:
            return False
        self.fs.create_dir(self.directory, recursive=True)
        copy_files(self.local, self.directory, source_filesystem=LocalFileSystem(), destination_filesystem=self.fs)
        self._published = misses
        return True
