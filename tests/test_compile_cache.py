"""The experiment's compile cache (altgrad.tune.compile_cache): what one trial process compiled, a
later trial process does not compile again -- on the same machine from the experiment's directory,
and on another node (its own empty temp dir) from a real S3-compatible bucket. A step graph
included: AOTAutograd's cache holds it although it calls autograd.Functions, and is keyed on what
they compute."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# A trial process in miniature: use the experiment's compile cache at URI, compile a quantizer
# kernel -- and with argv[2] "ste" a step graph through the STE (an autograd.Function), with
# "doubled" one whose backward doubles the gradient -- publish; print how many files the cache
# held, the cache counters, whether it published and the step graph's gradient.
TRIAL = """
import importlib, json, sys, torch
from pyarrow.fs import FileSystem
from torch._dynamo.utils import counters
from altgrad.quant import quantize
from altgrad.quant.kernels import StepGraph
from altgrad.tune.compile_cache import CompileCache
q = importlib.import_module("altgrad.quant.quantize")  # (the package's `quantize` is the function)
step = sys.argv[2]
if step == "doubled":
    backward = q._StraightThrough.backward
    q._StraightThrough.backward = staticmethod(lambda ctx, g: (2 * backward(ctx, g)[0], None, None, None, None))
cache = CompileCache(*FileSystem.from_uri(sys.argv[1]))
held = cache.use()
quantize(torch.linspace(-3, 3, 1000), "e4m3")
x = torch.linspace(-600, 600, 64, requires_grad=True)
if step != "kernel":
    StepGraph(lambda x: q.fake_quantize(x, "e4m3", clip_ste=True).square().sum())(x).backward()
published = cache.publish()
quantize(torch.linspace(-3, 3, 1000), "e5m2")  # the same graph: nothing new to publish
aot = counters["aot_autograd"]
print(json.dumps({"held": held, "published": published, "again": cache.publish(),
                  "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "aot_hits": aot["autograd_cache_hit"], "aot_misses": aot["autograd_cache_miss"],
                  "aot_bypasses": aot["autograd_cache_bypass"],
                  "grad": None if x.grad is None else x.grad.tolist(), "altgrad": q.__file__}))
"""


def trial(uri: str, workdir: Path, node: Path | None = None, step: str = "kernel",
          altgrad: Path | None = None) -> dict:
    """The trial in a fresh process in `workdir`, with no inductor cache of its own, on `node` (its
    temp dir, where inductor keeps what it keeps per machine: its precompiled headers) or, if none,
    on this machine (the headers other tests' compiles built), with the `altgrad` package found in
    that directory if given."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("ALTGRAD_NO_COMPILE", "TORCHINDUCTOR_CACHE_DIR")}
    if node is not None:
        node.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(node)
    if altgrad is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(altgrad), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", TRIAL, uri, step], env=env, cwd=workdir, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def changed_lowering(directory: Path) -> Path:
    """A copy of the altgrad package in `directory` whose step graph lowers nothing of what computes
    nothing (`kernels.computes_nothing`): those ops fall back to ATen, values unchanged. Its other
    files link to this package's, so that its step graph wrapper's precompiled header is this
    package's (keyed on the header's path: another would be a minute of g++ beside the point)."""
    import altgrad

    shutil.copytree(Path(altgrad.__file__).parent, directory / "altgrad", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    kernels = directory / "altgrad" / "quant" / "kernels.py"
    source = kernels.read_text()
    kernels.unlink()
    kernels.write_text(source + "\n\ndef computes_nothing(node):  # (the test's change)\n    return False\n")
    return directory


def test_local_storage_a_later_trial_compiles_nothing_again_step_graph_included(tmp_path):
    """A later trial compiles nothing: neither the kernel nor the step graph, which AOTAutograd
    refuses by default to cache because it calls autograd.Functions (the STE, the grad_output
    quantizer): it cannot tell that its key covers what a Function computes, so each trial traced
    its step graph again (docs/design.md). `StepGraph` allows it, safe because dynamo traces the
    Functions' forward and backward into the graph that is the key: a trial whose STE backward
    differs compiles anew and gets the new gradient. (One test: the first trial's cold compile is
    the slow part of all three checks.)"""
    cache = tmp_path / "experiment" / "compile_cache"
    first = trial(cache.as_uri(), tmp_path, step="ste")
    assert (first["held"], first["published"]) == (0, False) and first["misses"] > 0  # written in place
    assert first["aot_bypasses"] == 0 and first["aot_misses"] == 2  # the kernel and the step graph
    assert any(f.is_file() for f in cache.rglob("*"))
    later = trial(cache.as_uri(), tmp_path, step="ste")
    assert later["held"] > 0 and later["hits"] > 0 and later["misses"] == 0
    assert later["aot_hits"] == 2 and later["aot_misses"] == 0 and later["grad"] == first["grad"]
    doubled = trial(cache.as_uri(), tmp_path, step="doubled")
    assert doubled["aot_misses"] == 1 and doubled["aot_hits"] == 1  # the step graph; the kernel hit
    assert doubled["grad"] == [2 * g for g in first["grad"]] and any(first["grad"])
    # Another altgrad whose step graph lowers another set of ops: the graphs trace alike, and the
    # marks that decide the lowering are metadata neither cache's key reads, so without
    # `kernels.lowering_key` the changed altgrad was served this one's graphs (docs/design.md).
    changed = changed_lowering(tmp_path / "changed")
    relowered = trial(cache.as_uri(), tmp_path, step="ste", altgrad=changed)
    assert Path(relowered["altgrad"]).is_relative_to(changed)
    assert relowered["aot_misses"] == 1 and relowered["aot_hits"] == 1  # the step graph; the kernel hit
    assert relowered["grad"] == first["grad"]  # lowering changes no value


def test_remote_storage_a_trial_on_another_node_fetches_what_one_published(s3_bucket, tmp_path):
    uri = f"{s3_bucket}/cache-test/experiment/compile_cache"
    # a node of its own: the copy a trial fetches is kept in its temp dir, named after the bucket's
    # path, and on this machine's would outlive the test (a second run of it would start warm)
    first = trial(uri, tmp_path, node=tmp_path / "node-a")
    assert (first["held"], first["published"], first["again"]) == (0, True, False) and first["misses"] > 0
    other = trial(uri, tmp_path, node=tmp_path / "node-b")  # another node: nothing in its temp dir
    assert other["held"] > 0 and other["hits"] > 0 and other["misses"] == 0
    assert not other["published"]  # it compiled nothing new, so it uploads nothing
