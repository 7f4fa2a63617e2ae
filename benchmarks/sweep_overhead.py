"""What Ray Tune costs a sweep at the cpu preset, measured on a real (small) sweep.

    python benchmarks/sweep_overhead.py [--smoke] [--keep DIR] [--set key=value ...] [--record [DIR]]

- overhead: the sweep's wall time (the Tune run, Ray already up, before the report) against the
  sum of its trials' own training time divided by the concurrency; target <= 25 %. Split into
  the trials' own start-up (building model and data, before their first step) and the rest
  (Ray: actors, scheduling, reporting, checkpoint persistence, the driver's bookkeeping).
- time to first result: Tune run start to the first metrics row of any trial.
- checkpoint cost: the time Tune adds to a report that carries a checkpoint (persisting it into
  the experiment), per checkpoint and spread over all reports. Reports carry checkpoints only on
  remote storage (see altgrad/tune/trainable.py); this is the local copy's cost, a lower bound.
ASHA is off so that every trial runs its full length; W&B and the dashboard are off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import yaml
from record import Claim, add_record_argument, write

from altgrad.config import ConfigError
from altgrad.data import prepare_dataset
from altgrad.experiment import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    RUN_DIR,
    STATE_DIR,
    TRIALS_DIR,
    TRIALS_FILE,
    SweepStatus,
    load_experiment,
)
from altgrad.metrics import STEP, TOKENS_PER_S
from altgrad.train.checkpoint import step_checkpoints
from altgrad.tune.ablation import FormatAblation
from altgrad.tune.config import SweepConfig, load_sweep_config
from altgrad.tune.grid import concurrency, machine_resources
from altgrad.tune.runner import run_experiment, start_ray

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "sweeps" / "configs" / "format_ablation.yaml"
GRID = ["preset=cpu", "grid.formats=[e2m5, e3m4, e4m3, e5m2]", "grid.optimizers=[adamw]",
        "grid.precisions=[all, mlp]", "grid.seeds=[42]", "asha.enabled=false", "wandb.enabled=false",
        "dashboard.enabled=false"]
SMOKE = ["grid.formats=[bf16, e4m3, e5m2]", "grid.precisions=[all]", "base.train.max_steps=20"]
TARGET = 0.25


def train_seconds(trial_dir: Path) -> float:
    """A trial's own training time: the trainer's per-step time summed over its logged steps."""
    run = trial_dir / RUN_DIR
    cfg = yaml.safe_load((run / CONFIG_FILE).read_text())
    tokens = cfg["train"]["batch_size"] * cfg["model"]["block_size"]
    rows = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines() if line]
    total, prev = 0.0, 0
    for row in rows:
        total += tokens / row[TOKENS_PER_S] * (row[STEP] - prev)
        prev = row[STEP]
    return total


def persist_seconds(checkpoint_dir: Path, reps: int = 5) -> float:
    """Median time Tune takes to persist one of these checkpoints into the experiment (the copy
    `tune.report(..., checkpoint=...)` makes, done with Ray's own copy function)."""
    from ray.train._internal.storage import _pyarrow_fs_copy_files

    times = []
    with tempfile.TemporaryDirectory(dir=checkpoint_dir.parents[4]) as scratch:  # the experiment
        for i in range(reps):
            t0 = time.perf_counter()
            Path(scratch, str(i)).mkdir()
            _pyarrow_fs_copy_files(str(checkpoint_dir), f"{scratch}/{i}")
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def first_result_watch(exp_dir: Path) -> list[float]:
    """Background poll for the first metrics row of any trial; appends its time."""
    seen: list[float] = []

    def poll() -> None:
        while not seen:
            if any(p.stat().st_size for p in exp_dir.glob(f"{TRIALS_DIR}/*/{RUN_DIR}/{METRICS_FILE}")):
                seen.append(time.perf_counter())
            time.sleep(0.01)

    threading.Thread(target=poll, daemon=True).start()
    return seen


def trial_startup_seconds(ray_dir: Path, run_dir: Path) -> float:
    """Time from the trial function's start to its first report, less its first step."""
    first_report = json.loads((ray_dir / "result.json").read_text().splitlines()[0])
    first_row = json.loads((run_dir / METRICS_FILE).read_text().splitlines()[0])
    cfg = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    step = cfg["train"]["batch_size"] * cfg["model"]["block_size"] / first_row[TOKENS_PER_S]
    return max(0.0, first_report["time_this_iter_s"] - step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="3 trials of 20 steps")
    parser.add_argument("--keep", type=Path, help="storage path to keep the experiment in")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    overrides = GRID + (SMOKE if args.smoke else []) + args.overrides
    storage = args.keep or Path(tempfile.mkdtemp(prefix="sweep-overhead-"))
    try:
        cfg = load_sweep_config(SweepConfig, CONFIG, overrides, name=f"overhead-{time.strftime('%Y%m%d-%H%M%S')}",
                                storage_path=str(storage))
    except ConfigError as e:
        parser.error(str(e))
    (experiment,) = FormatAblation.experiments(cfg)
    exp_dir = Path(cfg.experiment_path)
    prepare_dataset(cfg.base_run.data)

    t0 = time.perf_counter()
    start_ray(cfg.dashboard)
    ray_start = time.perf_counter() - t0
    first = first_result_watch(exp_dir)
    t1 = time.perf_counter()
    outcome, _ = run_experiment(experiment, restore=False, resume_command="")
    wall = time.perf_counter() - t1
    if outcome is not SweepStatus.FINISHED:
        print(f"the sweep did not finish ({outcome.value})")
        return 2
    FormatAblation.summarize(cfg, [experiment])

    records = load_experiment(exp_dir)
    index = json.loads((exp_dir / STATE_DIR / TRIALS_FILE).read_text()).values()
    ray_dirs = {e["key"]: exp_dir / e["dir"] for e in index}
    train = sum(train_seconds(r.trial_dir) for r in records)
    startup = sum(trial_startup_seconds(ray_dirs[r.key], r.trial_dir / RUN_DIR) for r in records)
    at_once = min(concurrency(cfg, *machine_resources()), len(records))
    ideal = train / at_once
    overhead = wall / ideal - 1
    run = cfg.base_run.train
    checkpoint = step_checkpoints(records[0].trial_dir / RUN_DIR / CHECKPOINTS_DIR)[-1]
    per_ckpt = persist_seconds(checkpoint)
    size_mb = sum(f.stat().st_size for f in checkpoint.iterdir()) / 2**20
    step_time = train / sum(r.summary["steps"] for r in records)
    results = {
        "trials": len(records), "steps_per_trial": run.max_steps, "concurrency": at_once,
        "ray_start_s": round(ray_start, 2), "sweep_wall_s": round(wall, 2),
        "trial_training_s": round(train, 2), "ideal_wall_s": round(ideal, 2),
        "overhead": round(overhead, 4),
        "of_which_trial_startup": round(startup / at_once / ideal, 4),
        "time_to_first_result_s": round(first[0] - t1, 2) if first else None,
        "step_s": round(step_time, 4), "checkpoint_mb": round(size_mb, 1),
        "checkpoint_cost_s": round(per_ckpt, 4),
        "checkpoint_cost_per_report_s": round(per_ckpt / run.checkpoint_interval * run.log_interval, 4),
        "experiment": str(exp_dir),
    }
    print(json.dumps(results, indent=1))
    print(f"overhead {100 * overhead:.1f} % of the ideal {ideal:.1f} s (target <= {100 * TARGET:.0f} %): "
          f"{'PASS' if overhead <= TARGET else 'FAIL'}; of it, the trials' own start-up "
          f"{100 * results['of_which_trial_startup']:.1f} %; first result after "
          f"{results['time_to_first_result_s']} s; Tune persisting a {size_mb:.0f} MB checkpoint adds "
          f"{per_ckpt * 1000:.0f} ms to its report ({1000 * results['checkpoint_cost_per_report_s']:.1f} ms "
          f"per report, {100 * per_ckpt / run.checkpoint_interval / step_time:.2f} % of the step time)")
    if args.record:
        claim = Claim(f"sweep wall time ({len(records)} trials x {run.max_steps} steps, {at_once} at once)",
                      wall / ideal, "trials' own training time / concurrency", 1 + TARGET,
                      f"{wall:.0f} vs {ideal:.0f} s; first result after {results['time_to_first_result_s']} s")
        print(f"recorded in {write('sweep_overhead', [claim], args.record)}")
    return 0 if overhead <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
