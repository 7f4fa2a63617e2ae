"""The experiment's compile cache (altgrad.tune.compile_cache): what one trial process compiled, a
trial process with an empty inductor cache (another node, a replaced spot instance) loads instead
of compiling."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from pyarrow.fs import LocalFileSystem

from altgrad.tune import compile_cache

# A trial process in miniature: load the experiment's cache (or not), compile a quantizer kernel,
# save what it compiled; print the inductor cache counters and what load / save returned.
TRIAL = """
import json, sys, torch
from pyarrow.fs import LocalFileSystem
from torch._dynamo.utils import counters
from altgrad.quant import quantize
from altgrad.tune import compile_cache
fs, cache, load = LocalFileSystem(), sys.argv[1], sys.argv[2] == "load"
loaded = compile_cache.load(fs, cache) if load else 0
quantize(torch.linspace(-3, 3, 1000), "e4m3")
saved = sys.argv[3] != "-" and compile_cache.save(fs, cache, sys.argv[3])
print(json.dumps({"loaded": loaded, "saved": saved, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def trial(tmp_path: Path, inductor: str, load: bool, name: str) -> dict:
    """The trial in a fresh process with its own inductor cache; it saves as `name` ('-': not)."""
    env = {**{k: v for k, v in os.environ.items() if k != "ALTGRAD_NO_COMPILE"},
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor)}
    out = subprocess.run([sys.executable, "-c", TRIAL, str(tmp_path / "compile_cache"),
                          "load" if load else "no", name],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_trial_on_an_empty_inductor_cache_loads_what_an_earlier_trial_compiled(tmp_path):
    first = trial(tmp_path, "node-a", load=False, name="first")
    assert first["misses"] > 0 and first["saved"]
    assert (tmp_path / "compile_cache" / "first.bin").is_file()
    assert not list((tmp_path / "compile_cache").glob("*.partial"))

    # Another node: its inductor cache is empty; without the experiment's cache it compiles ...
    assert trial(tmp_path, "node-b", load=False, name="-")["misses"] > 0
    # ... with it, it compiles nothing and so saves nothing.
    warm = trial(tmp_path, "node-c", load=True, name="warm")
    assert (warm["loaded"], warm["misses"], warm["saved"]) == (1, 0, False)
    assert warm["hits"] > 0
    assert not (tmp_path / "compile_cache" / "warm.bin").exists()


def test_an_unreadable_artifact_file_is_skipped_with_a_warning(tmp_path, caplog):
    cache = tmp_path / "compile_cache"
    cache.mkdir()
    (cache / "partial-upload.bin").write_bytes(b"not a cache artifact")
    (cache / "notes.txt").write_text("not an artifact file at all")
    with caplog.at_level(logging.WARNING, logger="altgrad.tune.trial"):
        assert compile_cache.load(LocalFileSystem(), str(cache)) == 0
    assert "partial-upload.bin" in caplog.text and "notes.txt" not in caplog.text
    assert compile_cache.load(LocalFileSystem(), str(tmp_path / "never-made")) == 0
