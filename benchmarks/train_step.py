"""Median training-step time at a preset: what fake quantization, diagnostics and the shadow cost.

All variants live in this one process and take their steps interleaved (A B C D, B C D A, ...),
so machine noise lands on every variant alike; ratios are against the bf16 baseline of the run:

    bf16            no fake quantization (the baseline)
    e4m3            e4m3 `all`, diagnostics and shadow off
    e4m3 per-tensor ... with `train.compile: false`: one compiled call per quantized tensor
    e4m3+diag       ... plus every diagnostic every step
    e4m3+diag+shadow ... plus the FP32 shadow every `shadow_every` steps (amortized)

Targets (`TARGETS`, per preset): e4m3 against bf16, diagnostics every step against e4m3, the
shadow against e4m3+diag.

`--preset host` is the host-bound proxy of a GPU step: the cpu preset with a model too small to
compute anything (6 layers 16 wide, 8 tokens, batch 1), so a step's time is the host's per-call
overhead (Python, dispatch, compiled-call guards), which is what bounds the gpu preset's step on a
GPU. Like the gpu preset it compiles the step graph (`train.compile`), for every variant, and its
bf16 step does the same number of layers, so the ratios say what quantization and diagnostics cost
per call. `--set train.compile=false` measures the per-tensor compiled calls instead.

    python benchmarks/train_step.py [--preset cpu|gpu|host] [--variants bf16,e4m3] [--steps N] [--smoke]
                                    [--record [DIR]]

`--variants` picks a subset (bf16, the baseline, always runs; the targets whose two variants both
ran are checked): each variant is a step graph of its own to compile, the slow part on a GPU.

`--repeat N` takes the whole measurement in N fresh processes, one after another, and checks each
target on the median of their N ratios, printing every process's ratio and in how many the target
held. Interleaving evens out noise within a process, not between processes: this 2-core VM runs a
whole process at one of a few speeds, and the host proxy's e4m3 ratio moves with it (docs/design.md
has the runs), so one process can pass or fail a target that sits at its edge.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from record import Claim, add_record_argument, write

from altgrad.config import ConfigError, build_run_config
from altgrad.train import Trainer

# Named bundles of run-config overrides on top of a RunConfig preset.
BENCH_PRESETS = {
    "host": ("cpu", ["model.n_layer=6", "model.n_head=2", "model.n_embd=16", "model.block_size=8",
                     "train.batch_size=1", "train.compile=true"]),
}

VARIANTS = {
    "bf16": ["quant.format=bf16", "train.diag_every=0", "train.shadow_every=0"],
    "e4m3": ["quant.format=e4m3", "train.diag_every=0", "train.shadow_every=0"],
    "e4m3 per-tensor": ["quant.format=e4m3", "train.diag_every=0", "train.shadow_every=0", "train.compile=false"],
    "e4m3+diag": ["quant.format=e4m3", "train.diag_every=1", "train.shadow_every=0"],
    "e4m3+diag+shadow": ["quant.format=e4m3", "train.diag_every=1", "train.shadow_every=10"],
}
# (variant, reference variant, maximum ratio), per preset. On the host-bound proxy each quantized
# tensor's host overhead is the whole cost, so it gets the looser bound; the cpu preset's must not
# regress from what it measures now. Where the preset compiles the step graph, it must beat the
# per-tensor calls.
TARGETS = {
    "cpu": [("e4m3", "bf16", 1.25), ("e4m3+diag", "e4m3", 1.15), ("e4m3+diag+shadow", "e4m3+diag", 1.2)],
    "host": [("e4m3", "bf16", 1.3), ("e4m3+diag", "e4m3", 1.25), ("e4m3+diag+shadow", "e4m3+diag", 1.2),
             ("e4m3", "e4m3 per-tensor", 1.0)],
    "gpu": [("e4m3", "bf16", 1.4), ("e4m3+diag", "e4m3", 1.25), ("e4m3+diag+shadow", "e4m3+diag", 1.2),
            ("e4m3", "e4m3 per-tensor", 1.0)],
}


def build(overrides: list[str], total_steps: int, workdir: Path) -> Trainer:
    """A trainer whose steps never evaluate or checkpoint (step 1 and the last one would)."""
    never = 10 * total_steps
    workdir.mkdir(parents=True)  # train_step without fit: bit positions still go to the run dir
    cfg = build_run_config({}, [*overrides, f"train.max_steps={never}", "train.warmup_steps=0",
                                f"train.eval_interval={never}", f"train.checkpoint_interval={never}"])
    return Trainer(cfg, workdir)


def interleaved(names: list[str], steps: range) -> Iterator[tuple[int, str]]:
    """(step, variant) for each step and each variant, each step's variants in a rotated order (A B C,
    B C A, ...), so that machine noise lands on every variant alike."""
    for step in steps:
        k = step % len(names)
        for name in names[k:] + names[:k]:
            yield step, name


def timed_step(trainer: Trainer, step: int) -> float:
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.train_step(step)  # ends in the step's one host sync
    return time.perf_counter() - start


def add_preset_arguments(parser: argparse.ArgumentParser) -> None:
    """--preset (a RunConfig preset or a BENCH_PRESETS bundle; another name is a usage error, exit
    2) and --set (`preset_overrides` reads both)."""
    parser.add_argument("--preset", default="auto", choices=("auto", "cpu", "gpu", *BENCH_PRESETS),
                        help=f"cpu | gpu | auto (gpu when CUDA is available) | {' | '.join(BENCH_PRESETS)}")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def preset_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The run-config overrides of --preset (a BENCH_PRESETS bundle expanded), then --set's,
    checked here: a bad one is a usage error (exit 2), not a traceback from a trainer later."""
    preset, bundle = BENCH_PRESETS.get(args.preset, (args.preset, []))
    overrides = [f"preset={preset}", *bundle, *args.overrides]
    try:
        build_run_config({}, overrides)
    except ConfigError as e:
        parser.error(str(e))
    return overrides


def add_training_arguments(parser: argparse.ArgumentParser, steps: int, per: str) -> None:
    """The options of a benchmark that trains the preset's model (`training_run` reads them)."""
    add_preset_arguments(parser)
    parser.add_argument("--steps", type=int, default=steps, help=f"timed steps per {per}")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    parser.add_argument("--smoke", action="store_true", help="3 timed steps, to check the script runs")


def training_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], int, int]:
    """`preset_overrides`, the timed steps and the warm-up steps (--smoke: 3 and 2)."""
    steps, warmup = (3, 2) if args.smoke else (args.steps, args.warmup)
    return preset_overrides(parser, args), steps, warmup


def add_variants_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--variants", default=default, help=f"comma-separated, of {', '.join(VARIANTS)}")


def chosen_variants(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The `--variants` names, in VARIANTS' order; an unknown name is a usage error (exit 2)."""
    names = text.split(",")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    return [name for name in VARIANTS if name in names]


@dataclass(frozen=True)
class Measurement:
    """What one process measured: each variant's median step time and its first step (s)."""

    medians: dict[str, float]
    first: dict[str, float]
    steps: int
    pid: int = field(default_factory=os.getpid)

    def ratio(self, name: str, ref: str) -> float:
        return self.medians[name] / self.medians[ref]

    def detail(self, name: str, ref: str) -> str:
        return f"{1000 * self.medians[name]:.1f} vs {1000 * self.medians[ref]:.1f} ms"


def measure(common: list[str], variants: list[str], steps: int, warmup: int) -> Measurement:
    """Build a trainer per variant and time their steps, interleaved (`interleaved`)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: build([*common, *VARIANTS[name]], steps + warmup, Path(tmp) / name)
                    for name in variants}
        times: dict[str, list[float]] = {name: [] for name in trainers}
        first: dict[str, float] = {}  # the first step: compiling (a warm compile cache shortens it)
        for step, name in interleaved(list(trainers), range(2, warmup + steps + 2)):  # step 1 would evaluate
            t = timed_step(trainers[name], step)
            first.setdefault(name, t)
            if step > warmup + 1:
                times[name].append(t)
    return Measurement({name: statistics.median(ts) for name, ts in times.items()}, first, steps)


def measure_in_fresh_process(*args: object) -> Measurement:
    """`measure` in a process of its own (spawned: nothing of this one's state carries over)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, *args).result()


def print_steps(run: Measurement) -> None:
    print(f"{'variant':<18} {'median step':>12} {'vs bf16':>8} {'first step':>11}")
    for name, t in run.medians.items():
        print(f"{name:<18} {1000 * t:>10.1f}ms {t / run.medians['bf16']:>7.2f}x {run.first[name]:>10.1f}s")


def ratios(runs: list[Measurement], name: str, ref: str) -> list[float]:
    """Each process's ratio of `name` to `ref`."""
    return [run.ratio(name, ref) for run in runs]


def held(ratios: list[float], limit: float) -> str:
    return f"held in {sum(r <= limit for r in ratios)} of {len(ratios)}"


def target_claim(runs: list[Measurement], name: str, ref: str, limit: float) -> Claim:
    """A target checked on one run's ratio, or on the median of several processes' ratios (each
    process's ratio and milliseconds in the detail, and in how many the target held)."""
    if len(runs) == 1:
        run = runs[0]
        return Claim(name, run.ratio(name, ref), ref, limit, f"{run.detail(name, ref)}, median of {run.steps} steps")
    each_ratio = ratios(runs, name, ref)
    each = ", ".join(f"{r:.2f}x ({run.detail(name, ref)})" for r, run in zip(each_ratio, runs, strict=True))
    return Claim(name, statistics.median(each_ratio), ref, limit,
                 f"median of {len(runs)} processes, each the median of {runs[0].steps} steps: {each}; "
                 f"{held(each_ratio, limit)}")


def target_line(runs: list[Measurement], claim: Claim) -> str:
    """The printed verdict on a target: its ratio, or the median and every process's ratio."""
    ratio, where = f"{claim.ratio:.2f}x", ""
    if len(runs) > 1:
        each_ratio = ratios(runs, claim.what, claim.baseline)
        ratio, where = (f"median {ratio} of {' '.join(f'{r:.2f}x' for r in each_ratio)}",
                        f"; {held(each_ratio, claim.target)}")
    return f"{claim.what} / {claim.baseline}: {ratio} (target <= {claim.target}x: {'ok' if claim.met else 'MISSED'}{where})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser, 30, "variant")
    add_variants_argument(parser, ",".join(VARIANTS))
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="measure in N fresh processes, one after another; targets on the median ratio")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    common, steps, warmup = training_run(parser, args)
    variants = chosen_variants(parser, f"bf16,{args.variants}")
    if args.record and variants != list(VARIANTS):
        parser.error("--record writes every target's claim: leave --variants out")
    if args.repeat < 1:
        parser.error("--repeat needs at least one process")

    measure_once = measure if args.repeat == 1 else measure_in_fresh_process
    runs = []
    for i in range(args.repeat):
        runs.append(measure_once(common, variants, steps, warmup))
        if args.repeat > 1:
            print(f"process {i + 1} of {args.repeat} (pid {runs[-1].pid}):")
        print_steps(runs[-1])
    preset = build_run_config({}, common).preset
    label = preset if args.preset == "auto" else args.preset
    targets = [(name, ref, limit) for name, ref, limit in TARGETS[label] if {name, ref} <= set(variants)]
    claims = [target_claim(runs, name, ref, limit) for name, ref, limit in targets]
    for claim in claims:
        print(target_line(runs, claim))
    if args.record:
        print(f"recorded in {write(f'train_step-{label}', claims, args.record)}")


if __name__ == "__main__":
    main()
