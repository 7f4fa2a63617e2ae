"""Runs one Tune experiment of a sweep: Ray, the Tuner (new or restored), signals, the outcome.

Interruptions: Ray turns the first SIGINT into a graceful stop (experiment state saved, trials
stopped) and then returns from `fit()` as if nothing happened; SIGTERM (a spot preemption, `kill`)
is routed into that same path. Whether the sweep finished is read from the trial index, not from
`fit()`, and an unfinished sweep exits non-zero with the exact command that resumes it. After a
SIGKILL there is nothing to catch: `Tuner.restore` picks up Ray's last experiment snapshot, and the
trainable resumes each trial from its own newest checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from altgrad.experiment import (
    SEARCH_FILE,
    SWEEP_FILE,
    TERMINAL_STATUSES,
    TRIALS_FILE,
    SweepStatus,
    TrialStatus,
)
from altgrad.provenance import process_commit
from altgrad.remote import filesystem, is_remote, split_name, without_query
from altgrad.tune.config import DashboardSettings, SweepSettings
from altgrad.tune.grid import GridPoint
from altgrad.tune.store import StateStore


@dataclass(frozen=True)
class Experiment:
    """One Tune experiment: where it lives and what runs in it."""

    settings: SweepSettings
    kind: str  # the entry point, e.g. "format_ablation"
    path: str  # the experiment directory (local, or s3://…)
    points: dict[str, GridPoint]  # by key: what the trials' `key` refers to
    param_space: dict[str, Any]
    trials: list[dict[str, Any]]  # labels of the trials known up front, in table order
    total_trials: int
    scheduler: Any = None
    search_alg: Any = None

    @property
    def store(self) -> StateStore:
        return StateStore(self.path)

    def outcome(self) -> SweepStatus:
        """How its fit ended (finished, errored or interrupted), from the trial index: the newest
        Ray trial of each grid key counts. A searcher that asked for no more trials
        (`SEARCH_FILE`) ends it once the trials it asked for have."""
        status = {e["key"]: e["status"] for e in (self.store.read(TRIALS_FILE) or {}).values()}
        ended = [s for s in status.values() if s in TERMINAL_STATUSES]
        if len(ended) < self.total_trials and not (len(ended) == len(status) and self.store.read(SEARCH_FILE)):
            return SweepStatus.INTERRUPTED
        return SweepStatus.ERRORED if TrialStatus.ERROR in ended else SweepStatus.FINISHED


def start_ray(d: DashboardSettings) -> None:
    """Start a local Ray (dashboard on the configured host) or join the cluster in RAY_ADDRESS."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        print(f"joined the Ray cluster at {os.environ['RAY_ADDRESS']}")
        return
    # Ray's INFO lines ("Started a local Ray instance", "Wrote the latest version of all result
    # files") repeat what the sweep prints itself; its warnings and errors still show. The token
    # warning is replaced by `dashboard_help`, which also says how to get past it.
    logging.getLogger(TOKEN_AUTH_LOGGER).setLevel(logging.ERROR)
    # Ray binds the port even without the dashboard (its minimal head), and logs an ERROR where it
    # is taken: a free one is chosen either way, and said only where someone will browse to it.
    port = dashboard_port(d.host, d.port, say=d.enabled)
    context = ray.init(include_dashboard=d.enabled, dashboard_host=d.host, dashboard_port=port,
                       logging_level=logging.WARNING)
    if d.enabled:
        print(dashboard_help(context.dashboard_url, d.host))


TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def dashboard_port(host: str, port: int, say: bool = True) -> int:
    """`port` if it is free on `host`, else a free one (said, with `say`): a dashboard of another
    Ray (a second sweep, a test run) on the configured port made `ray.init` fail the sweep."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
            return port
        except OSError:
            probe.bind((host, 0))
            free = probe.getsockname()[1]
    if say:
        print(f"dashboard port {port} on {host} is taken (another Ray?): using {free} "
              "(set dashboard.port to choose one)")
    return free


def dashboard_help(url: str | None, host: str) -> str:
    """The dashboard's URL and how to get past its token authentication."""
    if not url:
        return ("Ray dashboard: not running (see /tmp/ray/session_latest/logs/dashboard.log; it "
                "needs ray[default])")
    lines = [f"Ray dashboard: http://{url}"]
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        where = ("the RAY_AUTH_TOKEN environment variable" if os.environ.get("RAY_AUTH_TOKEN")
                 else os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token"))
        lines.append(
            f"  token authentication is on: when the page asks, paste the token that `ray "
            f"get-auth-token` prints (it is in {where}); API clients send "
            "`Authorization: Bearer <token>`. RAY_AUTH_MODE=disabled turns it off."
        )
    if host not in ("127.0.0.1", "localhost", "::1"):
        lines.append(f"  bound to {host}: reachable from the network")
    return "\n".join(lines)


def write_sweep_state(exp: Experiment, status: SweepStatus, resume_command: str) -> None:
    """sweep.json; `started` is kept from the first write: with the path it names this sweep (a
    `--fresh` one at the same path is another). So is `commit`, the code the sweep started with;
    `commits` lists the code of every driver that ran it (a resume may run newer code), and each
    trial's worker.json names its own."""
    before = exp.store.read(SWEEP_FILE) or {}
    started = before.get("started", time.time())
    commit = process_commit()
    exp.store.write(SWEEP_FILE, {
        "kind": exp.kind,
        "status": status,
        "config": exp.settings.model_dump(mode="json"),
        "points": exp.trials,
        "total_trials": exp.total_trials,
        "resume_command": resume_command,
        "driver": {"pid": os.getpid(), "host": socket.gethostname(), "beat": time.time()},
        "commit": before.get("commit", commit),
        "commits": list(dict.fromkeys([*before.get("commits", []), commit])),
        "started": started,
        "updated": time.time(),
    })


def run_experiment(exp: Experiment, restore: bool, resume_command: str) -> tuple[SweepStatus, int | None]:
    """Fit the experiment; returns its outcome and the signal that interrupted it, if any."""
    from ray import tune

    write_sweep_state(exp, SweepStatus.RUNNING, resume_command)
    # Frequent experiment snapshots are what a resume after SIGKILL wants; Ray warns about them.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # Tune's default console output prints a configuration box and a TensorBoard hint even at
    # verbose=0; its classic reporter at verbose=0 prints nothing. `SweepProgress` prints one line
    # per trial event instead.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Tune adds a TensorBoard logger by default, which warns on every non-finite metric (a
    # diverging format's whole tail) and whose files nothing reads; `_new_tuner` names the JSON
    # and CSV loggers it keeps.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    trainable = _trainable(exp)
    with _without_ray_noise():
        if restore and _restorable(exp.path):
            # Errored trials run again under their trial ids; the lr search's searcher counts on it
            # (`GridThenEdge.restore`).
            tuner = tune.Tuner.restore(exp.path, trainable=trainable, resume_errored=True)
        else:  # never started, or killed before Ray's first snapshot: trials find their checkpoints
            tuner = _new_tuner(exp, trainable)
        with sigterm_stops_gracefully() as received:
            try:
                tuner.fit()
            except KeyboardInterrupt:  # a second Ctrl-C during Ray's own shutdown
                received.append(signal.SIGINT)
    outcome = exp.outcome()
    write_sweep_state(exp, outcome, resume_command)
    if outcome is SweepStatus.INTERRUPTED:
        return outcome, received[0] if received else signal.SIGINT
    return outcome, None


# How Tune's warning after an interrupted `fit()` begins; it ends "Resume experiment with:
# Tuner.restore(...)", which would restore without the sweep's grid, scheduler state and settings.
RAY_INTERRUPTED_PREFIX = "Experiment has been interrupted"
# How Tune's warning begins when a restore or an interrupted `fit()` reads the results of trials
# that have none yet (not started): one line per such trial, each a FileNotFoundError.
RAY_NO_METRICS_PREFIX = "Failed to fetch metrics for"


def is_ray_noise(record: logging.LogRecord) -> bool:
    """Tune's resume hint (the sweep prints the command that resumes it instead), and its warning
    that trials not yet started have no results, where that is all it says."""
    message = record.getMessage()
    if message.startswith(RAY_INTERRUPTED_PREFIX):
        return True
    failures = message.splitlines()[1:]
    return message.startswith(RAY_NO_METRICS_PREFIX) and all("FileNotFoundError(" in f for f in failures)


@contextlib.contextmanager
def _without_ray_noise() -> Iterator[None]:
    """Tune's log lines that `is_ray_noise` names left out."""
    loggers = [logging.getLogger(n) for n in ("ray.tune.tune", "ray.tune.analysis.experiment_analysis")]
    def keep(record: logging.LogRecord) -> bool:
        return not is_ray_noise(record)

    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(keep)


def _restorable(path: str) -> bool:
    """Ray can restore only once it wrote its first experiment snapshot (not just tuner.pkl)."""
    from pyarrow.fs import FileSelector

    fs, root = filesystem(path if is_remote(path) else str(Path(path).resolve()))
    names = [f.base_name for f in fs.get_file_info(FileSelector(root, allow_not_found=True))]
    return "tuner.pkl" in names and any(n.startswith("experiment_state-") for n in names)


def _trainable(exp: Experiment):
    """`train_trial` with the grid's run configs and W&B settings bound (object store) and its
    resources."""
    from ray import tune

    from altgrad.tune.trainable import train_trial
    from altgrad.tune.wandb_runs import WandbSpec

    s = exp.settings
    r = s.resources
    runs = {key: point.run for key, point in exp.points.items()}
    wandb = None
    if s.wandb.enabled and s.wandb.mode != "disabled":
        # (the query names how storage is reached, not which sweep: a resume may spell it otherwise)
        sweep_id = f"{without_query(exp.path)}@{exp.store.read(SWEEP_FILE)['started']}"
        wandb = WandbSpec(s.wandb.project, s.wandb.mode, group=split_name(exp.path)[1],
                          sweep_id=sweep_id)
    return tune.with_resources(tune.with_parameters(train_trial, runs=runs, wandb=wandb),
                               {"cpu": r.cpus_per_trial, "gpu": r.gpu_per_trial})


def _new_tuner(exp: Experiment, trainable):
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    from altgrad.tune.heartbeat import DriverHeartbeat
    from altgrad.tune.index import TrialIndex
    from altgrad.tune.progress import SweepProgress
    from altgrad.tune.stopper import StabilityStopper
    from altgrad.tune.trial_spec import trial_dirname, trial_name

    s = exp.settings
    storage_path, name = split_name(exp.path)
    remote = is_remote(exp.path)
    callbacks: list[Any] = [TrialIndex(exp.store, {k: p.labels for k, p in exp.points.items()}),
                            SweepProgress(exp.store, exp.total_trials), DriverHeartbeat(exp.store),
                            JsonLoggerCallback(), CSVLoggerCallback()]
    stopper = None
    if s.stopper.enabled:
        stopper = StabilityStopper(exp.store, {key: p.run_config.stability for key, p in exp.points.items()})
    return tune.Tuner(
        trainable,
        param_space=exp.param_space,
        tune_config=tune.TuneConfig(
            scheduler=exp.scheduler,
            search_alg=exp.search_alg,
            num_samples=exp.total_trials if exp.search_alg is not None else 1,
            max_concurrent_trials=s.max_concurrent_trials,
            reuse_actors=True,
            trial_name_creator=trial_name,
            trial_dirname_creator=trial_dirname,
        ),
        run_config=tune.RunConfig(
            name=name,
            storage_path=storage_path,
            stop=stopper,
            callbacks=callbacks,
            failure_config=tune.FailureConfig(max_failures=s.failure.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=s.checkpoint.num_to_keep),
            sync_config=tune.SyncConfig(sync_artifacts=remote),
            verbose=0,  # SweepProgress prints one line per trial instead
        ),
    )


@contextlib.contextmanager
def sigterm_stops_gracefully() -> Iterator[list[int]]:
    """SIGTERM takes Ray's SIGINT path (save the experiment state, stop the trials)."""
    received: list[int] = []

    def on_sigterm(signum: int, frame) -> None:
        received.append(signum)
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
