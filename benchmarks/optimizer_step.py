"""Median optimizer-step time: the manifold optimizer vs fused AdamW on the same converted model.

Both run in this one process, their steps interleaved, on the preset's GPT converted to `--format` (every linear
quantized), with the same fixed random gradients and `found_inf` set as the trainer sets it.
Target: manifold <= 1.3x AdamW. On a CPU shared with other work the ratio depends as much on
thread contention as on the kernels (each kernel call is an OpenMP region that may wait for a busy
core), so compare runs at a fixed `--threads`, and several runs: on this project's 2-core machine the
ratio moved 1.19-1.34x between runs of 200 steps (within a run, the median is stable to ~0.01).

    python benchmarks/optimizer_step.py [--preset cpu|gpu] [--format e5m2] [--reps N] [--threads N] [--smoke]
        [--record [DIR]]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from record import Claim, add_record_argument, write

from altgrad.config import build_run_config
from altgrad.optim import build_optimizer
from altgrad.quant import FORMATS
from altgrad.run_model import build_model
from altgrad.train.trainer import resolve_device

TARGET = 1.3


def setup(name: str, preset: str, fmt: str) -> tuple[torch.optim.Optimizer, torch.device]:
    """The preset's model converted to `fmt`, its optimizer `name`, fixed random gradients."""
    cfg = build_run_config({"preset": preset}, [f"quant.format={fmt}", f"optim.name={name}"])
    device = resolve_device(cfg.train.device)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    optimizer = build_optimizer(name, model, cfg.optim)
    optimizer.found_inf = torch.zeros((), device=device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    return optimizer, device


def timed_step(optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--format", default="e5m2", choices=list(FORMATS))
    ap.add_argument("--reps", type=int, default=200, help="timed steps per optimizer (each ~5 ms)")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--smoke", action="store_true", help="3 reps, 1 warm-up: checks it runs")
    add_record_argument(ap)
    args = ap.parse_args(argv)
    reps, warmup = (3, 1) if args.smoke else (args.reps, 5)
    if args.threads:
        torch.set_num_threads(args.threads)
    optimizers = {n: setup(n, args.preset, args.format) for n in ("adamw", "manifold")}
    times: dict[str, list[float]] = {n: [] for n in optimizers}
    for i in range(warmup + reps):  # interleaved, so a busy machine slows both alike
        for name, (optimizer, device) in optimizers.items():
            t = timed_step(optimizer, device)
            if i >= warmup:
                times[name].append(t)
    medians = {n: statistics.median(ts) for n, ts in times.items()}
    ratio = medians["manifold"] / medians["adamw"]
    for name, t in medians.items():
        print(f"{name:>9}: {1e3 * t:8.2f} ms/step")
    print(f"ratio manifold/adamw: {ratio:.2f}x (target <= {TARGET}x): {'ok' if ratio <= TARGET else 'OVER'}")
    if args.record:
        threads = f"{args.threads} threads" if args.threads else f"{torch.get_num_threads()} threads"
        claim = Claim(f"manifold optimizer step ({args.format} weights)", ratio, "fused AdamW, same model", TARGET,
                      f"{1e3 * medians['manifold']:.2f} vs {1e3 * medians['adamw']:.2f} ms, median of {reps}, {threads}")
        print(f"recorded in {write(f'optimizer_step-{args.preset}', [claim], args.record)}")


if __name__ == "__main__":
    main()
