"""A cold trial's first step with the step graph wrapper's headers precompiled as one, against
inductor's own precompiled header (`altgrad.quant.precompiled_headers`).

On the CPU g++ compiles a C++ wrapper for every step graph, against a header precompiled once per
machine (in the node's temp dir). Each run below is a fresh process with an empty compile cache,
timing a cold trial's construction and first step as `warm_trial.py` does (the host-bound proxy's
e4m3 trainer), with one of the two headers:

    wrapper header   `step_graph_wrapper.h`, what a step graph is built against
    inductor's       inductor's own (`cpp_wrapper/cpu.h` alone): the baseline

Each header gets a node of its own. Its first run there also precompiles the header (once per
machine); the runs after it find it precompiled, as every later trial on that machine does. The
two headers' runs alternate.

    python benchmarks/compile_step.py [--repeat N] [--record [DIR]]
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from record import Claim, write
from warm_trial import first_step, parse_trial_arguments, trial_seconds

HEADERS = ("wrapper header", "inductor's")
TARGET = 1.0  # of inductor's time: a header that holds more must not make the trial slower


def main(argv: list[str] | None = None) -> None:
    args = parse_trial_arguments(argv, __doc__, "header", HEADERS, repeat=(1, "runs of each header after its first"))
    if args.header:
        if args.header == "inductor's":
            from altgrad.quant import precompiled_headers

            precompiled_headers.wrapper_headers = lambda compiling: contextlib.nullcontext()
        print(json.dumps({"seconds": first_step(args.workdir, str(args.cache), remote=False)}))
        return

    seconds: dict[str, list[float]] = {header: [] for header in HEADERS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for i in range(1 + args.repeat):
            for j, header in enumerate(HEADERS):
                run_dir = tmp / f"{i}-{j}"
                seconds[header].append(trial_seconds(__file__, ["--header", header], run_dir / "cache",
                                                     run_dir / "run", tmp / f"node-{j}"))
    first = {header: s[0] for header, s in seconds.items()}
    later = {header: statistics.median(s[1:]) for header, s in seconds.items()}
    base = HEADERS[1]
    print(f"{'header':<16} {'first on its node':>18} {'later (median)':>15} {'vs ' + base:>15}")
    for header in HEADERS:
        print(f"{header:<16} {first[header]:>17.1f}s {later[header]:>14.1f}s {later[header] / later[base]:>14.2f}x")
    if args.record:
        detail = (f"{later[HEADERS[0]]:.1f} vs {later[base]:.1f} s, median of {args.repeat}; a node's first, "
                  f"precompiling the header too: {first[HEADERS[0]]:.1f} vs {first[base]:.1f} s")
        claims = [Claim("first step, cold, wrapper header", later[HEADERS[0]] / later[base],
                        "the same, inductor's header", TARGET, detail)]
        print(f"recorded in {write('compile_step', claims, args.record)}")


if __name__ == "__main__":
    main()
