"""Median training-step time at a preset: what fake quantization, diagnostics and the shadow cost.

All variants run in this one process, against the bf16 baseline measured in the same run:

    bf16            no fake quantization (the baseline)
    e4m3            e4m3 `all`, diagnostics and shadow off
    e4m3+diag       ... plus every diagnostic every step
    e4m3+diag+shadow ... plus the FP32 shadow every `shadow_every` steps (amortized)

Targets: e4m3 <= 1.4x bf16; diagnostics every step add <= 25 % over e4m3; the shadow adds
<= 1.2x over e4m3+diag.

    python benchmarks/train_step.py [--preset cpu|gpu] [--steps N] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from altgrad.config import build_run_config
from altgrad.train import Trainer

VARIANTS = {
    "bf16": ["quant.format=bf16", "train.diag_every=0", "train.shadow_every=0"],
    "e4m3": ["quant.format=e4m3", "train.diag_every=0", "train.shadow_every=0"],
    "e4m3+diag": ["quant.format=e4m3", "train.diag_every=1", "train.shadow_every=0"],
    "e4m3+diag+shadow": ["quant.format=e4m3", "train.diag_every=1", "train.shadow_every=10"],
}
TARGETS = {  # variant -> (reference variant, maximum ratio)
    "e4m3": ("bf16", 1.4),
    "e4m3+diag": ("e4m3", 1.25),
    "e4m3+diag+shadow": ("e4m3+diag", 1.2),
}


def step_times(overrides: list[str], steps: int, warmup: int, workdir: Path) -> list[float]:
    """Per-step wall times (s) of a run, warm-up steps dropped; evaluation kept out of the way."""
    cfg = build_run_config({}, [*overrides, f"train.max_steps={steps + warmup}", "train.warmup_steps=0",
                                f"train.eval_interval={10 * (steps + warmup)}",
                                f"train.checkpoint_interval={10 * (steps + warmup)}"])
    times: list[float] = []

    def record(metrics: dict[str, float], _checkpoint) -> None:
        step = int(metrics["step"])
        if warmup < step < steps + warmup:  # step 1 and the last step also evaluate
            times.append(cfg.train.batch_size * cfg.model.block_size / metrics["train/tokens_per_s"])

    Trainer(cfg, workdir).fit(report=record)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="auto", help="cpu | gpu | auto (gpu when CUDA is available)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    parser.add_argument("--smoke", action="store_true", help="3 timed steps, to check the script runs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    steps, warmup = (3, 2) if args.smoke else (args.steps, args.warmup)

    medians: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in VARIANTS.items():
            times = step_times([f"preset={args.preset}", *args.overrides, *overrides], steps, warmup,
                               Path(tmp) / name)
            medians[name] = statistics.median(times)

    print(f"{'variant':<18} {'median step':>12} {'vs bf16':>8}  target")
    for name, t in medians.items():
        target = ""
        if name in TARGETS:
            ref, limit = TARGETS[name]
            ratio = t / medians[ref]
            target = f"{ratio:.2f}x {ref} (<= {limit}x: {'ok' if ratio <= limit else 'MISSED'})"
        print(f"{name:<18} {1000 * t:>10.1f}ms {t / medians['bf16']:>7.2f}x  {target}")


if __name__ == "__main__":
    main()
