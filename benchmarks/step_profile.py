"""Where a training step's time goes: kernel launches, host syncs and the top ops, per variant.

Builds the variants of `train_step.py`, warms them up, then profiles one step of each with
torch.profiler and prints launches, CPU and device time and the ops that cost most. On CUDA it
also lists every host sync with the Python lines that caused it (SPEC §5 allows one per step).

    python benchmarks/step_profile.py [--preset cpu|gpu|host] [--variants bf16,e4m3,e4m3+diag] [--rows 15]
                                      [--set KEY=VALUE] [--smoke]

`--preset host` is `train_step.py`'s host-bound proxy (the same bundle of overrides); `--smoke`
warms up for one step instead of four.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from train_step import (
    VARIANTS,
    add_preset_arguments,
    add_variants_argument,
    build,
    chosen_variants,
    preset_overrides,
)


def host_syncs(step) -> collections.Counter:
    """Syncs during step(), keyed by the altgrad/torch.optim lines on the stack (CUDA only)."""
    found: collections.Counter = collections.Counter()

    def record(message, *args, **kwargs) -> None:
        if "called a synchronizing" in str(message):
            frames = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]
                      if "altgrad" in f.filename or "torch/optim" in f.filename]
            found[" < ".join(reversed(frames[-4:])) or "(no altgrad frame)"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return found


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_preset_arguments(ap)
    add_variants_argument(ap, "bf16,e4m3,e4m3+diag")
    ap.add_argument("--rows", type=int, default=15, help="ops listed per variant")
    ap.add_argument("--smoke", action="store_true", help="one warm-up step, to check the script runs")
    args = ap.parse_args(argv)
    variants, common = chosen_variants(ap, args.variants), preset_overrides(ap, args)
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            trainer = build([*common, *VARIANTS[name]], 100, Path(tmp) / name)
            for step in range(2, 3 if args.smoke else 6):  # step 1 would evaluate
                trainer.train_step(step)
            cuda = trainer.device.type == "cuda"
            print(f"== {name}")
            if cuda:
                syncs = host_syncs(lambda: trainer.train_step(6))  # noqa: B023 - called at once
                print(f"host syncs: {sum(syncs.values())}")
                for where, n in syncs.most_common():
                    print(f"  {n:4d}  {where}")
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                trainer.train_step(7)
                if cuda:
                    torch.cuda.synchronize()
            ops = prof.key_averages()
            line = f"CPU {sum(e.self_cpu_time_total for e in ops) / 1e3:.1f} ms"
            if cuda:
                launches = sum(e.count for e in ops if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                 "cuLaunchKernelEx"))
                line += f"; device {sum(e.self_device_time_total for e in ops) / 1e3:.1f} ms; {launches} launches"
            print(line)
            sort = "self_device_time_total" if cuda else "self_cpu_time_total"
            print(ops.table(sort_by=sort, row_limit=args.rows))


if __name__ == "__main__":
    main()
