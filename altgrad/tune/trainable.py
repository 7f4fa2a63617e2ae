"""The Tune trainable: a thin adapter that runs one `Trainer` for one trial.

Per trial it builds the RunConfig from the trial config, holds torch to its share of the machine
(threads = its CPUs, GPU memory = its GPU fraction), keeps `trial.log` and `worker.json` next to
the run directory in the trial directory, compiles into the experiment's compile cache
(`compile_cache`: a trial on a new node need not compile what another trial did), and resumes
from the newest checkpoint it can find: its own run directory first (after a driver kill that is
at most one checkpoint interval old), else Tune's checkpoint (a retry on another node). Every
trainer report goes to `tune.report`, plus what the sweep's deciders need (`SweepSignals`).

Checkpoints are attached to the reports only on remote storage, where a node's trial directory
dies with the node. On local storage the run directory is itself durable, and a Tune checkpoint
would only add a hazard: Tune deletes its older checkpoints before it next saves the experiment
state, so a driver killed in between leaves a state whose checkpoint is gone, and Ray then
refuses to restore that trial.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from pyarrow.fs import FileSystem, FileType, LocalFileSystem, copy_files
from ray import tune

from altgrad.config import StabilityConfig
from altgrad.experiment import (
    CHECKPOINT_FILE,
    COMPILE_CACHE_DIR,
    METRICS_FILE,
    RUN_DIR,
    TRIAL_LOG_FILE,
    TRIALS_DIR,
    WORKER_FILE,
    read_jsonl,
)
from altgrad.metrics import (
    BIT_STALL_RATE,
    DIVERGED,
    LOSS_IS_NAN,
    STABLE_LR,
    STALL_STREAK,
    STEP,
    TRAIN_LOSS,
    VAL_LOSS,
    VAL_STEP,
    model_wide,
)
from altgrad.provenance import process_commit
from altgrad.quant.kernels import compiling_disabled
from altgrad.train import Trainer
from altgrad.train.checkpoint import resume_candidates
from altgrad.train.resources import limit_resources
from altgrad.train.stability import stall_halts_learning
from altgrad.tune.compile_cache import CompileCache
from altgrad.tune.stopper import stability_stop
from altgrad.tune.trial_spec import learning_tolerance, trial_key, trial_run_config, verdict, worst
from altgrad.tune.wandb_runs import TrialRun, WandbSpec, trial_run

log = logging.getLogger("altgrad.tune.trial")


def train_trial(config: dict[str, Any], runs: dict[str, dict[str, Any]], wandb: WandbSpec | None = None) -> None:
    """Run (or resume) the trial's training to its end; Tune may stop it at any report.

    `runs` maps grid keys to run configs, `wandb` says where the trial's W&B run goes (None: no
    W&B); both bound once with `tune.with_parameters`."""
    cfg = trial_run_config(config, runs[config["key"]])
    trial_dir = local_trial_dir(trial_key(config))
    run_dir = trial_dir / RUN_DIR
    limit_resources(config["limits"]["cpus"], config["limits"]["gpu_fraction"])
    logging.getLogger("ray.train").setLevel(logging.WARNING)  # no line per persisted checkpoint
    storage = tune.get_context().get_storage()
    cache = None if compiling_disabled() else CompileCache(
        storage.storage_filesystem, f"{storage.experiment_fs_path}/{COMPILE_CACHE_DIR}")
    with trial_log(trial_dir / TRIAL_LOG_FILE):
        (trial_dir / WORKER_FILE).write_text(json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "node": ray.get_runtime_context().get_node_id(),
             "started": time.time(), "commit": process_commit()}))
        if cache is not None:
            log.info("trial %s: compile cache %s: %d files", trial_key(config), cache.directory, cache.use())
        history = read_jsonl(run_dir / METRICS_FILE)  # read before the trainer trims it
        with trial_run(wandb, trial_key(config), cfg.model_dump(mode="json"), run_dir, trial_dir) as run:
            reporter = TuneReporter(SweepSignals(cfg.stability, cfg.optim.lr,
                                                 stall_halts_learning(cfg), learning_tolerance(config)),
                                    history, attach_checkpoints=not storage_is_local(), wandb_run=run,
                                    compile_cache=cache)
            with resume_point(run_dir) as resume:
                log.info("trial %s: %s", trial_key(config), f"resuming from {resume}" if resume else "starting")
                summary = Trainer(cfg, run_dir).fit(report=reporter, resume=resume,
                                                    on_event=None if run is None else run.event)
            reporter.report_if_silent()
        if cache is not None and cache.publish():  # graphs compiled after the first report
            log.info("trial %s: copied what it compiled to the compile cache", trial_key(config))
        log.info("trial %s: %s after %s steps, best val loss %.4f; first step %s s after start, %s",
                 trial_key(config), summary["stop_reason"], summary["steps"], summary["best_val_loss"],
                 summary["first_step_s"], summary["compile"])


def local_trial_dir(key: str) -> Path:
    """`<experiment>/trials/<key>` when storage is local: the same for every attempt at this grid
    point, even when Ray re-creates the trial under a new directory after a kill. On remote
    storage, the working directory that Tune syncs into its trial directory."""
    storage = tune.get_context().get_storage()
    if storage_is_local():
        path = Path(storage.experiment_fs_path) / TRIALS_DIR / key
    else:
        path = Path.cwd()
        if not (path / RUN_DIR).exists():  # a retry on another node: fetch the synced run dir
            fetch_run_dir(storage.storage_filesystem, f"{storage.trial_fs_path}/{RUN_DIR}", path / RUN_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


def storage_is_local() -> bool:
    return tune.get_context().get_storage().storage_filesystem.type_name == "local"


def fetch_run_dir(filesystem: FileSystem, source: str, destination: Path) -> None:
    """Copy the trial's run dir `source` on remote storage to `destination`, whole or not at all
    (nothing when the storage has none).

    It is copied beside `destination` and renamed into place: a trial killed mid-fetch on a node
    that lives on is retried in the same working dir, where a partial run dir would be taken for
    a fetched one (no second fetch) and resumed from whatever part of it had arrived. The caller
    fetches only where `destination` does not exist yet."""
    if filesystem.get_file_info(source).type == FileType.Directory:
        partial = destination.with_name(f"{destination.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)  # a killed fetch's
        partial.mkdir(parents=True)  # copy_files makes the sub-folders, not the root
        copy_files(source, str(partial), source_filesystem=filesystem,
                   destination_filesystem=LocalFileSystem())
        partial.rename(destination)


@contextlib.contextmanager
def trial_log(path: Path) -> Iterator[None]:
    """Send this trial's log lines (and its traceback, if it fails) to `path`. Tune stops a trial
    (its scheduler, its stopper) by `SystemExit` inside `report`: a stop, not a failure."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("altgrad")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (None, 0):
            log.info("trial stopped by Tune")
        else:
            log.exception("trial failed")
        raise
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


@contextlib.contextmanager
def resume_point(run_dir: Path) -> Iterator[Path | None]:
    """The run dir if its newest checkpoint has its file, else Tune's latest checkpoint, else the
    run dir if an older checkpoint has its file, else None: the trial starts over.

    A checkpoint directory without its file is what a run dir fetched from remote storage holds
    when its machine died while Tune was uploading it (the directory is made before the file is
    sent). Tune's own checkpoint of that step, if the driver recorded it before it died, went up
    whole: the trial resumes from there, not from an older one. Where there is none, an older whole
    one of the run dir, or a start from scratch (training is deterministic: the same trial)."""
    candidates = resume_candidates(run_dir)
    whole = [c for c in candidates if (c / CHECKPOINT_FILE).is_file()]
    if whole and whole[0] == candidates[0]:
        yield run_dir
        return
    if candidates:
        log.info("%s: no checkpoint file in %s", run_dir, candidates[0].name)
    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        yield run_dir if whole else None
        return
    with checkpoint.as_directory() as path:
        yield Path(path)


class SweepSignals:
    """What the sweep's deciders read on top of the trainer's metrics, from the stream of rows.

    - `val/loss` as ASHA sees it: +inf where the evaluation is non-finite. Not where this step's
      training loss is NaN: the trainer skips such a step, and the stability stopper ends a run
      only after `nan_patience` of them in a row; a single one on a rung's step ended a run the
      stability policy calls healthy (for the learning-rate search's verdict it still counts);
    - `sweep/stall_streak`: consecutive reports with bit-stall at or above the run's
      `stability.stall_stop`, for a run where stall halts learning (`stall_halts_learning`), else
      always 0;
    - `sweep/stable_lr` and `sweep/diverged`: the run's peak learning rate while it learns
      stably, else 0 (the learning-rate search maximizes it), and 1 where it has diverged, else 0:
      `trial_spec.verdict` of its evaluations so far, this report, and the stop the stability
      stopper would make on it (`stopper.stability_stop`). A run's last report says what the
      search's table says of its record.
    Fed the run's history before the first new report on resume, so the values match a run that
    never stopped.
    """

    def __init__(self, stability: StabilityConfig, lr: float, counts_stall: bool = True, tolerance: float = 0.0):
        self.stability = stability
        self.lr = lr
        self.counts_stall = counts_stall
        self.tolerance = tolerance
        self.stall_streak = 0
        self.first_val: float | None = None
        self.worst_val = -math.inf  # `verdict`'s: the largest val loss so far

    def observe(self, row: dict[str, float]) -> dict[str, float]:
        rate = row.get(BIT_STALL_RATE)
        if rate is not None and self.counts_stall:  # rows without diagnostics leave the streak alone
            self.stall_streak = self.stall_streak + 1 if rate >= self.stability.stall_stop else 0
        val = row[VAL_LOSS]
        if row.get(VAL_STEP) == row[STEP]:
            if self.first_val is None:
                self.first_val = val
            self.worst_val = worst([self.worst_val, val])
        broken = row.get(LOSS_IS_NAN, 0) > 0 or not math.isfinite(val)
        signals = {VAL_LOSS: val if math.isfinite(val) else math.inf, STALL_STREAK: float(self.stall_streak)}
        stop = stability_stop({**row, **signals}, self.stability)
        stable, gone = verdict(self.first_val, self.worst_val, val, broken, stop and stop["reason"], self.tolerance)
        return {**signals, STABLE_LR: self.lr if stable else 0.0, DIVERGED: float(gone)}


class TuneReporter:
    """The `report` callback of `Trainer.fit`: forwards to `tune.report` with `SweepSignals`."""

    def __init__(self, signals: SweepSignals, history: list[dict[str, Any]], attach_checkpoints: bool,
                 wandb_run: TrialRun | None = None, compile_cache: CompileCache | None = None):
        self.signals = signals
        self.compile_cache = compile_cache
        self.wandb_run = wandb_run
        self._history: list[dict[str, Any]] | None = history
        self._last = history[-1] if history else None
        self.attach_checkpoints = attach_checkpoints
        self._created = time.monotonic()  # until the first report: building, compiling, one step

    def __call__(self, metrics: dict[str, float], checkpoint_dir: Path | None, at_checkpoint: bool = False) -> None:
        """Report a logged row (`at_checkpoint`: the row is the checkpoint's own, re-reported by
        `report_if_silent`)."""
        step = metrics[STEP]
        if self._created is not None:
            log.info("first report (step %d) after %.1f s", step, time.monotonic() - self._created)
            self._created = None
            if self.compile_cache is not None and self.compile_cache.publish():  # before Tune may stop it
                log.info("copied what the first step compiled to the compile cache")
        if self._history is not None:  # resumed: replay what the run logged before this step
            replayed = None
            for row in self._history:
                if row.get(STEP, math.inf) < step:
                    replayed = self._reported(row)
                    if self.wandb_run is not None:  # rows a killed attempt's W&B run lost
                        self.wandb_run.log(replayed)
            self._history = None
            if replayed is not None and not at_checkpoint:
                # the checkpoint's own row, again: the kill may have come before Tune got it, and the
                # scheduler must see a rung reached there at that step, as an unbroken run's did
                # (its deciders take a row they have seen again as they took it the first time)
                tune.report(replayed)
        out = self._reported(metrics)
        if metrics[VAL_STEP] == step or checkpoint_dir is not None:
            log.info("step %d: train loss %.4f, val loss %.4f%s", step, metrics[TRAIN_LOSS],
                     metrics[VAL_LOSS], f", checkpoint {checkpoint_dir.name}" if checkpoint_dir else "")
        attach = checkpoint_dir is not None and self.attach_checkpoints
        checkpoint = tune.Checkpoint.from_directory(str(checkpoint_dir)) if attach else None
        if self.wandb_run is not None:  # first: Tune may stop the trial inside `report`
            self.wandb_run.log(out)
        tune.report(out, checkpoint=checkpoint)
        self._last = None

    def _reported(self, metrics: dict[str, float]) -> dict[str, float]:
        """What Tune (its loggers, W&B, the deciders) gets of a row: the model-wide metrics and the
        sweep's signals; the per-layer ones (`quant/overflow_rate/h.0.mlp.c_fc`, ...) stay in the
        run directory's metrics.jsonl."""
        return {**{k: v for k, v in metrics.items() if model_wide(k)}, **self.signals.observe(metrics)}

    def report_if_silent(self) -> None:
        """Report the run's last logged row again if this attempt reported nothing.

        A driver killed after a trial's last step but before Tune recorded its end restarts the
        trial; resumed at its end, the run trains no step, and Tune's scheduler would get a final
        result without `val/loss` and fail the whole sweep."""
        if self._last is not None:
            self(self._last, None, at_checkpoint=True)
