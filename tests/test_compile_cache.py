"""The experiment's compile cache (altgrad.tune.compile_cache): what one trial process compiled, a
later trial process does not compile again -- on the same machine from the experiment's directory,
and on another node (its own empty temp dir) from a real S3-compatible bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# A trial process in miniature: use the experiment's compile cache at URI, compile a quantizer
# kernel, publish; print how many files the cache held, the inductor cache counters and whether
# it published.
TRIAL = """
import json, sys, torch
from pyarrow.fs import FileSystem
from torch._dynamo.utils import counters
from altgrad.quant import quantize
from altgrad.tune.compile_cache import CompileCache
cache = CompileCache(*FileSystem.from_uri(sys.argv[1]))
held = cache.use()
quantize(torch.linspace(-3, 3, 1000), "e4m3")
published = cache.publish()
quantize(torch.linspace(-3, 3, 1000), "e5m2")  # the same graph: nothing new to publish
print(json.dumps({"held": held, "published": published, "again": cache.publish(),
                  "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def trial(uri: str, node: Path) -> dict:
    """The trial in a fresh process on `node` (its temp dir; no inductor cache of its own)."""
    node.mkdir(parents=True, exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k not in ("ALTGRAD_NO_COMPILE", "TORCHINDUCTOR_CACHE_DIR")},
           "TMPDIR": str(node)}
    out = subprocess.run([sys.executable, "-c", TRIAL, uri], env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_local_storage_a_later_trial_compiles_nothing_again(tmp_path):
    cache = tmp_path / "experiment" / "compile_cache"
    first = trial(cache.as_uri(), tmp_path / "node")
    assert (first["held"], first["published"]) == (0, False) and first["misses"] > 0  # written in place
    assert any(f.is_file() for f in cache.rglob("*"))
    later = trial(cache.as_uri(), tmp_path / "node")
    assert later["held"] > 0 and later["hits"] > 0 and later["misses"] == 0
    # the comparison can fail: the same trial with an empty cache compiles
    assert trial((tmp_path / "other" / "compile_cache").as_uri(), tmp_path / "node")["misses"] > 0


def test_remote_storage_a_trial_on_another_node_fetches_what_one_published(s3_bucket, tmp_path):
    uri = f"{s3_bucket}/cache-test/experiment/compile_cache"
    first = trial(uri, tmp_path / "node-a")
    assert (first["held"], first["published"], first["again"]) == (0, True, False) and first["misses"] > 0
    other = trial(uri, tmp_path / "node-b")  # another node: nothing in its temp dir
    assert other["held"] > 0 and other["hits"] > 0 and other["misses"] == 0
    assert not other["published"]  # it compiled nothing new, so it uploads nothing
