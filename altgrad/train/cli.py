"""`python -m altgrad train`: one training run, outside any sweep."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from altgrad.config import ConfigError, load_config
from altgrad.data import DataError
from altgrad.experiment import CONFIG_FILE, SUMMARY_FILE, EventKind, StopReason, read_json
from altgrad.metrics import (
    BIT_STALL_RATE,
    OVERFLOW_RATE,
    STEP,
    TOKENS_PER_S,
    TRAIN_LOSS,
    TRAIN_LR,
    UNDERFLOW_RATE,
    VAL_LOSS,
    VAL_STEP,
)
from altgrad.train.checkpoint import CheckpointError, resume_candidates
from altgrad.train.run_files import RunFileError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train one model (one format, optimizer and layer precision)",
                       description="Train one model (one format, optimizer and layer precision) outside any "
                                   "sweep: a run directory with its config, metrics, events, summary and "
                                   "checkpoints; --resume continues it.")
    p.add_argument("--config", type=Path, help="run config YAML (default: preset only)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set quant.format=e5m2 (repeatable)")
    p.add_argument("--out", type=Path, help="run directory (default: runs/<time>-<format>-<optimizer>)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue a run from its newest good checkpoint, with the run's own config "
                        "(a --set changes it from there on, and the run's events say what changed)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from altgrad.run_model import check_layer_policy
    from altgrad.train.trainer import Trainer

    run_dir = None
    resume = args.resume  # where training continues from: a run dir, or None (from step 0)
    claimed = False  # whether this run made run_dir: removed again if nothing was written to it
    try:
        if args.resume is not None:
            if args.config is not None:
                raise ConfigError("--resume uses the run's own config.yaml; drop --config")
            if args.out is not None:
                raise ConfigError("--resume continues the run in its own directory; drop --out")
            if not (args.resume / CONFIG_FILE).is_file():
                raise ConfigError(not_a_run_dir(args.resume))
            cfg = load_config(args.resume / CONFIG_FILE, args.overrides)
            check_layer_policy(cfg)  # `--set` may name new rules
            run_dir = args.resume
            try:
                done = read_json(run_dir / SUMMARY_FILE) or {}
            except ValueError:  # a torn summary: the resume writes it anew
                done = {}
            if (done.get("stop_reason"), done.get("steps")) == (StopReason.COMPLETED, cfg.train.max_steps):
                # (resumed anyway, it would train nothing and rewrite its summary as a process that did)
                print(f"{run_dir} is complete ({cfg.train.max_steps} steps): nothing to train; "
                      "--set train.max_steps=N continues it to step N")
                return 0
            if not resume_candidates(run_dir):
                # stopped before its first checkpoint: continuing is starting over, and the steps
                # it had logged come out the same again (batches and inits are functions of the seed)
                print(f"{run_dir}: no checkpoint yet (stopped before its first): training it again from "
                      "step 0 with its own config", file=sys.stderr)
                resume = None
        else:
            cfg = load_config(args.config, args.overrides)
            check_layer_policy(cfg)
            claimed = args.out is None or not args.out.exists()
            run_dir = new_run_dir(args.out, f"{cfg.quant.format}-{cfg.optim.name}")
        trainer = Trainer(cfg, run_dir)
        summary = trainer.fit(
            report=None if args.quiet else ProgressPrinter(cfg.train.max_steps),
            resume=resume,
            on_event=say_changed_settings,
        )
    except (ConfigError, DataError, CheckpointError, RunFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        _drop_if_unused(run_dir, claimed)
        return 2
    except KeyboardInterrupt:
        if run_dir is not None and (run_dir / CONFIG_FILE).is_file():
            print(f"interrupted: continue from the newest checkpoint with python -m altgrad train --resume "
                  f"{shlex.quote(str(run_dir))}", file=sys.stderr)
        else:
            print("interrupted before training started", file=sys.stderr)
            _drop_if_unused(run_dir, claimed)
        return 130
    print(
        f"done: {summary['stop_reason']} after {summary['steps']} steps, best val loss "
        f"{summary['best_val_loss']:.4f}, run dir {run_dir}"
    )
    return 0 if summary["stop_reason"] == StopReason.COMPLETED else 1


def say_changed_settings(event: dict[str, Any]) -> None:
    """A resume whose `--set` changed the run's settings says so (the events record it too): the
    run is then not one run of one config (a longer max_steps stretches its lr schedule)."""
    if event["kind"] == EventKind.RESUME and event.get("changed"):
        print(f"note: {event['message']}", file=sys.stderr)


def _drop_if_unused(run_dir: Path | None, claimed: bool) -> None:
    """Remove the directory this run made (`claimed`) if nothing was written to it."""
    if claimed and run_dir is not None and run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def not_a_run_dir(path: Path) -> str:
    """Why `--resume PATH` cannot continue: PATH has no config.yaml. When PATH lies inside a run
    (a checkpoint, its checkpoints folder), the message names that run: continuing from an older
    checkpoint in place would cut the run's later metrics, so a run continues from its newest."""
    run = next((p for p in path.resolve().parents if (p / CONFIG_FILE).is_file()), None)
    if run is None:
        return f"--resume {path}: not a run directory (no {CONFIG_FILE})"
    return (f"--resume {path}: give the run directory, --resume {run}; a run continues from its newest "
            "good checkpoint (an older one would overwrite the run's later metrics)")


def new_run_dir(out: Path | None, name: str) -> Path:
    """The directory of a new run, made here: `out`, which must not hold anything yet (a new run
    there would delete an earlier run's metrics and mix its checkpoints with the earlier ones), or
    by default runs/<time>-<name>, so that two runs started in the same second get two directories.
    Made before the data is prepared: a path that cannot be a directory fails first."""
    if out is not None:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out}: a file, not a directory")
        if out.is_dir() and any(out.iterdir()):
            raise ConfigError(f"--out {out} is not empty: continue the run there with --resume {out}, "
                              "or give a new directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file above it, or a place that holds no directories (/proc)
            raise ConfigError(f"--out {out}: cannot make this directory ({e.strerror})") from None
        return out
    base = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    for attempt in range(1, 100):
        run_dir = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
        try:
            run_dir.mkdir(parents=True)
            return run_dir
        except FileExistsError:
            continue
        except OSError as e:  # `runs` is a file, or cannot be written
            raise ConfigError(f"cannot make a run directory {run_dir} ({e.strerror}): give one with --out") from None
    raise ConfigError(f"no free run directory next to {base}: give one with --out")


class ProgressPrinter:
    """One line per evaluation (and at checkpoints): the numbers a researcher watches."""

    def __init__(self, max_steps: int):
        self.width = len(str(max_steps))
        self.max_steps = max_steps

    def __call__(self, m: dict[str, float], checkpoint: Path | None) -> None:
        step = int(m[STEP])
        if m[VAL_STEP] != step and checkpoint is None:
            return
        parts = [
            f"step {step:>{self.width}}/{self.max_steps}",
            f"loss {m[TRAIN_LOSS]:.4f}",
            f"val {m[VAL_LOSS]:.4f}",
            f"lr {m[TRAIN_LR]:.2e}",
            f"{m[TOKENS_PER_S]:,.0f} tok/s",
        ]
        for key, label in ((BIT_STALL_RATE, "stall"), (OVERFLOW_RATE, "ovf"),
                           (UNDERFLOW_RATE, "unf")):
            if key in m:
                parts.append(f"{label} {100 * m[key]:.2f}%")
        if checkpoint is not None:
            parts.append(f"ckpt {checkpoint.name}")
        print(" | ".join(parts), flush=True)
