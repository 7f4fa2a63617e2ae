"""A new node's precompiled headers, each keyed on the command that builds it, against inductor's key:
the command line of the file that includes it (`altgrad.quant.precompiled_headers`).

A node (a machine's temp dir) precompiles each header its C++ compiles include once, and every later
compile there reuses it. Inductor's key differs between a file compiled alone (`-c`: a wrapper whose
graph has fused loops, and those loops) and one compiled and linked at once (a wrapper of ATen calls
alone, such as a bf16 step graph's; a kernel compiled by itself, such as a per-tensor quantizer's),
so a node that meets both built each header twice. Each run below is a fresh process on a new node
with an empty compile cache, compiling one of each, cold: a step graph of ATen calls alone, one with
a fused loop, and a kernel by itself -- small ones, so that the headers are most of the time:

    building key     each header keyed on the command that builds it: what altgrad compiles with
    including key    inductor's own: the baseline

The two keys' runs alternate. Printed per key (medians): the seconds spent precompiling headers, the
header files built, and the whole compile.

    python benchmarks/node_headers.py [--repeat N] [--record [DIR]]
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from record import Claim, write
from warm_trial import parse_trial_arguments, trial_output

KEYS = ("building key", "including key")
TARGET = 1.0  # of the including key's header time: never more


def compile_both_kinds() -> tuple[float, int, float]:
    """In this process, on its node: compile one wrapper of each kind, cold. The seconds spent
    precompiling headers, the header files asked for, and the seconds of the whole."""
    import torch
    from torch._inductor import codecache

    from altgrad.quant.kernels import Kernel, StepGraph

    timed, spent, files = codecache._precompile_header, [0.0], set()

    def precompile_header(header: str, *args, **kwargs) -> str:
        start = time.perf_counter()
        path = timed(header, *args, **kwargs)
        spent[0] += time.perf_counter() - start
        files.add(path)
        return path

    codecache._precompile_header = precompile_header
    halved = Kernel(lambda x, s: (x / s).round() * s)
    x, weight = torch.randn(8, 32), torch.randn(32, requires_grad=True)

    def aten_only(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (32,), weight))

    start = time.perf_counter()
    for fn in (aten_only, lambda x, weight: halved(aten_only(x, weight), 0.5)):
        StepGraph(fn)(x, weight).sum().backward()
    halved(x, 0.5)
    return spent[0], len(files), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    args = parse_trial_arguments(argv, __doc__, "key", KEYS, repeat=(2, "runs of each key"))
    if args.key:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(args.cache)
        from torch._inductor import codecache

        from altgrad.quant import precompiled_headers

        inductors = codecache._precompile_header
        precompiled_headers.install()
        if args.key == "including key":
            codecache._precompile_header = inductors
        seconds, files, whole = compile_both_kinds()
        print(json.dumps({"seconds": seconds, "files": files, "whole": whole}))
        return

    runs: dict[str, list[dict]] = {key: [] for key in KEYS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for i in range(args.repeat):
            for j, key in enumerate(KEYS):
                run_dir = tmp / f"{i}-{j}"
                runs[key].append(trial_output(__file__, ["--key", key], run_dir / "cache", run_dir / "run",
                                              run_dir / "node"))
    median = {key: {what: statistics.median(run[what] for run in r) for what in ("seconds", "files", "whole")}
              for key, r in runs.items()}
    base = KEYS[1]
    print(f"{'key':<14} {'headers':>9} {'files':>6} {'whole':>8} {'vs ' + base:>17}")
    for key in KEYS:
        m = median[key]
        print(f"{key:<14} {m['seconds']:>8.1f}s {m['files']:>6.0f} {m['whole']:>7.1f}s "
              f"{m['seconds'] / median[base]['seconds']:>16.2f}x")
    if args.record:
        new, old = median[KEYS[0]], median[base]
        detail = (f"{new['seconds']:.1f} vs {old['seconds']:.1f} s, {new['files']:.0f} vs {old['files']:.0f} files, "
                  f"median of {args.repeat}; the whole compile {new['whole']:.1f} vs {old['whole']:.1f} s")
        claims = [Claim("a new node's header builds, building key", new["seconds"] / old["seconds"],
                        "the same, including key", TARGET, detail)]
        print(f"recorded in {write('node_headers', claims, args.record)}")


if __name__ == "__main__":
    main()
