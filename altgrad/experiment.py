"""What a finished (or running) trial looks like to readers: the trial table and the report.

Every name of the results is defined here once: files and folders, stop reasons, statuses and
event kinds; writers (the trainer, the sweep) and readers (the trial table, the report) use them.

A run directory, written by `altgrad.train.Trainer` and knowing nothing of Ray, holds:

- `config.yaml`      the validated RunConfig
- `metrics.jsonl`    one flat JSON object of floats per logged step (`step`, `train/loss`, ...;
                     `val/loss` carries the latest evaluation, whose step is `val/step`)
- `events.jsonl`     `{"step", "kind", "message", ...}` per event (`EventKind`)
- `summary.json`     `{"status" (RunStatus), "stop_reason" (StopReason), "steps", "best_val_loss",
                     "final_val_loss", "collapse_step", "collapse_where", "wall_time_s",
                     "autocast" (bf16 autocast, else fp32, for what it does not quantize), ...}`,
                     rewritten as it goes
- `bit_positions.jsonl`  per diagnostic step, how far each quantized weight moved in codes
- `checkpoints/`     `step_XXXXXXXX/checkpoint.pt` and `meta.json` (its step and val loss; best +
                     last N), `anomaly_step_XXXXXXXX/`, `best.json` naming the best
- `wandb.json`       in a sweep with W&B: the trial's run id and the last step it logged

An experiment directory, written by a sweep (`altgrad.tune`) as `<storage_path>/<name>/`, holds
Ray's own files (`experiment_state-*.json`, `tuner.pkl`, and per Ray trial `<key>_<id>/` with
`result.json`, `checkpoint_XXXXXX/`, `error.txt`), our trial directories `trials/<key>/` (`run/`
the run directory, `trial.log` across every attempt, `worker.json` the current worker (pid, host,
Ray node id)), keyed by grid point so that a trial Ray re-creates after a kill finds its
checkpoints, the report (`report/report.md` and its plots), a learning-rate search's result
(`lr_search.json`), and the sweep's state in `sweep_state/` (a sub-folder, so that Ray's restore,
which copies the experiment root's `*.json` around, never touches it):

- `sweep.json`    the validated sweep config, the grid points in order, status, resume command and
                  the driver (pid, host, `beat`: its heartbeat time), `started` (with the path, the
                  sweep's identity: a `--fresh` sweep at the same path is another)
- `trials.json`   Ray trial id -> grid key, Ray's trial dir, status (`TrialStatus`)
- `asha.json`     the rung records and which trial a rung stopped, why (`asha` / `nan`), at which
                  step and the numbers (value, reference, how far behind, tolerance)
- `stopper.json`  which trial the stability stopper stopped, why (`nan` / `bit_stall`), when and
                  the streak that did it

`TrialRecord` is the in-memory view of one trial of a sweep: its grid coordinates plus the
contents of its run directory. Readers (`trials`, `report`) work on records only, and
`load_experiment` builds them from the files above without starting Ray.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from altgrad.config import StabilityConfig, flattened, read_yaml, utf8_text
from altgrad.metrics import STEP, VAL_LOSS, VAL_STEP
from altgrad.precision import BASELINE


class StopReason(StrEnum):
    """Why a trial ended: it ran its budget, its trainer or the sweep stopped it, or it crashed."""

    COMPLETED = "completed"
    ASHA = "asha"  # trailed its rung's reference by more than the tolerance
    NAN = "nan"  # a NaN streak of `stability.nan_patience` steps, or a non-finite val loss at a rung
    BIT_STALL = "bit_stall"  # stalled at `stability.stall_stop` for `stall_stop_reports` reports
    ERROR = "error"


# The trial broke (as opposed to completing its budget): the sweep stops only broken trials.
BROKEN_STOPS = tuple(r for r in StopReason if r is not StopReason.COMPLETED)


class TrialStatus(StrEnum):
    """A trial's status, as Ray names it (and `trials.json` records it)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    TERMINATED = "TERMINATED"
    ERROR = "ERROR"


TERMINAL_STATUSES = (TrialStatus.TERMINATED, TrialStatus.ERROR)
UNFINISHED = tuple(s for s in TrialStatus if s not in TERMINAL_STATUSES)


def unfinished_text(status: str) -> str:
    """How the tables and the report say an unfinished trial's state: a trial Ray lists as RUNNING
    in a sweep whose driver is gone is PAUSED (`read_experiment`): interrupted, not running."""
    return {TrialStatus.PENDING: "not started", TrialStatus.PAUSED: "interrupted"}.get(status, "still running")


class RunStatus(StrEnum):
    """`summary.json`'s status: the run's own, whatever Ray's status of its trial."""

    RUNNING = "running"
    FINISHED = "finished"  # its budget ran, or its trainer stopped it (`stop_reason`)
    STOPPED = "stopped"  # ended from outside before that: the sweep stopped its trial, Ctrl-C


class SweepStatus(StrEnum):
    """`sweep.json`'s status: the sweep's, as its driver last wrote it."""

    RUNNING = "running"
    FINISHED = "finished"  # every trial TERMINATED
    ERRORED = "errored"  # every trial ended, some in ERROR (a resume retries them)
    INTERRUPTED = "interrupted"  # stopped before the end; resumable


class EventKind(StrEnum):
    """The kinds of `events.jsonl` rows: what the trainer records and W&B raises as alerts."""

    NAN_SKIP = "nan_skip"  # a non-finite step, skipped
    NAN_STOP = "nan_stop"
    BIT_STALL_WARN = "bit_stall_warn"
    OVERFLOW_WARN = "overflow_warn"
    UNDERFLOW_WARN = "underflow_warn"
    KURTOSIS_WARN = "kurtosis_warn"
    DIVERGENCE_WARN = "divergence_warn"
    FORMAT_SHIFT = "format_shift"  # an emergency mantissa shift of one layer
    ANOMALY_CHECKPOINT = "anomaly_checkpoint"  # the pre-step state at the first NaN of a streak
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # a corrupt checkpoint passed over on resume
    RESUME = "resume"


STATE_DIR = "sweep_state"
SWEEP_FILE = "sweep.json"
TRIALS_FILE = "trials.json"
ASHA_FILE = "asha.json"
STOPPER_FILE = "stopper.json"
# A searched experiment whose searcher found that no further sample can change its answer (it asks
# for none, so the experiment ends with fewer trials than it allowed): the bracket it settled on.
SEARCH_FILE = "search.json"
TRIALS_DIR = "trials"  # our trial directories, one per grid key
RUN_DIR = "run"  # the Trainer's run directory inside a trial directory
# A run directory's files (written by `altgrad.train`, read here).
CONFIG_FILE, METRICS_FILE, EVENTS_FILE, SUMMARY_FILE = "config.yaml", "metrics.jsonl", "events.jsonl", "summary.json"
BIT_POSITIONS_FILE = "bit_positions.jsonl"
CHECKPOINTS_DIR, CHECKPOINT_FILE, BEST_FILE = "checkpoints", "checkpoint.pt", "best.json"
WANDB_STATE_FILE = "wandb.json"  # the trial's W&B run id and the last step a finished attempt logged
# A trial directory's files, next to its run directory.
WORKER_FILE = "worker.json"  # the process running it (pid, host, Ray node, start)
TRIAL_LOG_FILE = "trial.log"  # the trial's log lines across every attempt
COMPILE_CACHE_DIR = "compile_cache"  # what the trials compiled (altgrad.tune.compile_cache)
# An experiment's results, next to its trials.
REPORT_DIR, REPORT_FILE = "report", "report.md"
LR_SEARCH_FILE = "lr_search.json"  # a learning-rate search's table

# The driver refreshes `driver.beat` in sweep.json this often (`heartbeat.DriverHeartbeat`); a
# driver on another host whose beat is older than STALE_S is taken for gone (its node was lost).
BEAT_S, STALE_S = 30.0, 90.0


class ExperimentError(ValueError):
    """The path is not (or not yet) an AltGrad experiment directory, or it cannot be read; the
    message says what is wrong."""


@dataclass
class TrialRecord:
    trial_id: str
    format: str  # BASELINE (bf16) for the unquantized run
    optimizer: str
    precision: str  # "all" | "mlp" | "attn" | "no_head" | a custom policy's name
    seed: int = 0
    status: str = TrialStatus.PENDING
    # A StopReason once the trial has ended: the sweep's stop, else its trainer's (summary.json),
    # else `error` for a trial Ray lists as errored (filled in by __post_init__); None while it runs.
    stop_reason: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)  # every sampled hyper-parameter
    trial_dir: Path | None = None
    key: str = ""  # the grid point's name, e.g. "e4m3-adamw-all-s42"
    stop_step: int | None = None  # the step at which the sweep (ASHA / stopper) stopped the trial
    stop_detail: str | None = None  # why, with the numbers: "asha: 23 % behind bf16 at step 20 (...)"
    axes: dict[str, Any] = field(default_factory=dict)  # extra grid-axis values (dotted field -> value)
    same_as: str | None = None  # measured by this other grid point's trial (an equivalent format or precision)
    reference: str | None = None  # the grid key of its bf16 reference (same optimizer, seed, axes)
    error: str | None = None  # the last line of the trial's error, when it errored
    unreadable: str | None = None  # why the trial's files could not be read (file and line)
    # The thresholds the run's trainer acted on (its config.yaml); the defaults before it started.
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    # Whether what the run does not quantize computed in bf16 autocast (CUDA), not fp32; None: unknown.
    autocast: bool | None = None
    # Whether its weights were stored in their format (`quant.master_weights: format`), where a
    # stalled update is lost: only there is bit-stall a failure (over fp32 master weights, no).
    stored_in_format: bool = False
    # The run settings its format sets on top of the sweep's base (`grid.format_overrides`), by
    # dotted path: its numbers are then the format's with these settings, not the format's alone.
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stop_reason is None:
            errored = self.status == TrialStatus.ERROR
            self.stop_reason = self.summary.get("stop_reason") or (StopReason.ERROR if errored else None)

    @property
    def format_shifts(self) -> list[dict[str, Any]]:
        """The emergency mantissa shifts of its layers (SPEC §6), as its events record them, every
        step (the `quant/format_shifts` metric only on logged ones), up to the sweep's stop: after
        one, part of the model trains in another format than the trial's."""
        return [e for e in self.events if e.get("kind") == EventKind.FORMAT_SHIFT]

    @property
    def shifted_before_eval(self) -> bool:
        """Whether a format shift came before one of its evaluations, so that a number it measured
        is not its format's alone. A shift at step s applies from step s + 1 (the trainer shifts
        after the step, its evaluation included): one at or after its last evaluation changed
        nothing it measured."""
        steps, _ = self.val_series()
        return bool(self.format_shifts and steps) and self.format_shifts[0][STEP] < steps[-1]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the history, skipping rows that lack it."""
        rows = [r for r in self.history if key in r]
        return [int(r[STEP]) for r in rows], [float(r[key]) for r in rows]

    def val_series(self) -> tuple[list[int], list[float]]:
        """Validation loss at the steps where it was actually evaluated."""
        rows = [r for r in self.history if VAL_LOSS in r and r.get(VAL_STEP) == r[STEP]]
        return [int(r[STEP]) for r in rows], [float(r[VAL_LOSS]) for r in rows]

    def best_val_loss(self, upto: int | None = None) -> float:
        """The lowest finite validation loss evaluated up to step `upto` (all when None); inf when
        there is none, as the trainer's summary says. The summary's own `best_val_loss` counts when
        the steps it covers are within `upto`: it also holds evaluations at steps that were not
        logged (`train.log_interval`)."""
        steps, values = self.val_series()
        candidates: list[Any] = [v for s, v in zip(steps, values, strict=True) if upto is None or s <= upto]
        covered = self.summary.get("steps")
        if upto is None or (covered is not None and covered <= upto):
            candidates.append(self.summary.get("best_val_loss"))
        return min((v for v in candidates if isinstance(v, int | float) and math.isfinite(v)), default=math.inf)


def axis_names(paths: list[str]) -> dict[str, str]:
    """A short name per extra grid axis for trial keys and table columns: the last part of its
    dotted path (`rounding`), or more of it where two axes would share a name (`scaling.mode`)."""
    out = {}
    for path in paths:
        parts = path.split(".")
        for n in range(1, len(parts) + 1):
            short = ".".join(parts[-n:])
            if sum(p == short or p.endswith("." + short) for p in paths) == 1:
                break
        out[path] = short
    return out


def axis_value_text(value: Any) -> str:
    """An axis value as trial keys, columns and the report write it (`true`, `0.002`, `e5m2`): a
    float as `:g` writes it where that reads back as the same number, else with the digits it takes
    (`exact_g`): two values of an axis that agree to 6 digits would share a trial key, and one
    would not run."""
    if isinstance(value, bool):
        return str(value).lower()
    text = exact_g(value, 6) if isinstance(value, float) else str(value)
    return text.replace("/", "_")


def overrides_text(overrides: dict[str, Any]) -> str:
    """`optim.lr` = 3, `quant.master_weights` = format: a format's settings on top of a sweep's
    base (`TrialRecord.overrides`, dotted paths), as the dry run and the report write them."""
    return ", ".join(f"`{k}` = {axis_value_text(v) if isinstance(v, bool | int | float | str) else json.dumps(v)}"
                     for k, v in sorted(overrides.items()))


def exact_g(x: float, digits: int) -> str:
    """`x` in `g` notation with at least `digits` significant digits, and as many more as it takes
    to read back as `x` (names built from numbers must tell every two numbers apart)."""
    return next(text for d in range(digits, 18) if float(text := f"{x:.{d}g}") == x)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a JSON-lines file, tolerating a torn last line (a run killed mid-write)."""
    if not path.is_file():
        return []
    rows = []
    lines = utf8_text(path).splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return rows


def read_json(path: Path) -> Any:
    """A JSON file's content, or None when it does not exist (yet). ValueError naming the file
    when it is not JSON: json's own message says only where in it."""
    if not path.is_file():
        return None
    try:
        return json.loads(utf8_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _as_named(message: str, exp_dir: Path, shown: str | Path | None) -> str:
    """`message` with the paths under `exp_dir`, a fetched copy of a remote experiment, written as
    the user named the experiment (`s3://bucket/exp/...`): the temp dir is gone when they read it."""
    from altgrad.remote import without_query  # (it reads this module's file names)

    if shown is None or Path(shown) == exp_dir:
        return message
    return message.replace(str(exp_dir), without_query(shown).rstrip("/"))


def load_experiment(exp_dir: str | Path, shown: str | Path | None = None) -> list[TrialRecord]:
    """Every trial of a sweep in grid order, finished, running or not started; Ray is not needed.

    A trial that the sweep stopped (ASHA or the stability stopper) ends at the step of that
    decision: its history and summary are cut there, so the record does not depend on how far the
    trainer ran before the stop reached it (nor on a kill and resume in between). `shown` is the
    experiment as the user named it, for the errors (and the files unreadable trials name) when
    `exp_dir` is a fetched copy of a remote one.
    """
    exp_dir = Path(exp_dir)
    try:
        return _load_experiment(exp_dir, shown)
    except ExperimentError:
        raise
    except ValueError as e:  # a corrupt state file
        raise ValueError(_as_named(str(e), exp_dir, shown)) from None


def _load_experiment(exp_dir: Path, shown: str | Path | None) -> list[TrialRecord]:
    state = exp_dir / STATE_DIR
    sweep = read_json(state / SWEEP_FILE)
    if sweep is None:
        what = "does not exist" if not exp_dir.exists() else f"has no {STATE_DIR}/{SWEEP_FILE}"
        inside = sorted(p.parent.parent.name for p in exp_dir.glob(f"*/{STATE_DIR}/{SWEEP_FILE}"))
        hint = (f"it holds the experiments {', '.join(inside)} (one per format of a learning-rate "
                "search): pass one of them" if inside else
                "pass the directory a sweep printed, e.g. experiments/format_ablation")
        raise ExperimentError(f"{shown or exp_dir} is not an AltGrad experiment ({what}); {hint}")
    trials: dict[str, dict[str, Any]] = read_json(state / TRIALS_FILE) or {}
    stops = {tid: {"reason": StopReason.ASHA, **d} for tid, d in _stopped(state / ASHA_FILE).items()}
    stops.update(_stopped(state / STOPPER_FILE))
    by_key = {entry["key"]: tid for tid, entry in trials.items()}
    measured: dict[str, TrialRecord] = {}
    for point in sweep["points"]:
        if point.get("same_as"):
            continue
        tid = by_key.pop(point["key"], None)
        measured[point["key"]] = (_record(point, trial_id="", status=TrialStatus.PENDING) if tid is None else
                                  _trial_record(exp_dir, tid, {**point, **trials[tid]}, stops.get(tid), shown))
    records = [measured[p["key"]] if not p.get("same_as") else _alias(measured[p["same_as"]], p)
               for p in sweep["points"]]
    records += [_trial_record(exp_dir, tid, trials[tid], stops.get(tid), shown) for tid in by_key.values()]
    by_format = ((sweep.get("config") or {}).get("grid") or {}).get("format_overrides") or {}
    for r in records:
        r.overrides = flattened(by_format.get(r.format) or {})
    return records


@dataclass(frozen=True)
class ExperimentSnapshot:
    """An experiment as read at one moment: its sweep may still be running."""

    name: str  # the experiment directory's own name
    sweep: dict[str, Any]  # its sweep.json
    records: list[TrialRecord]  # every trial, as `load_experiment` reads them


def read_experiment(experiment: str | Path) -> ExperimentSnapshot:
    """The experiment at a local path or on object storage, for the commands that read one
    (`trials`, `report`). ExperimentError, its message naming the path, when it is not an
    experiment, a sweep file is corrupt, or its storage cannot be read; a corrupt trial file only
    marks that trial `unreadable`."""
    # `altgrad.remote` reads the file names defined here
    from altgrad.remote import cannot, readable, storage_errors

    try:
        with readable(experiment) as exp_dir:
            records = load_experiment(exp_dir, shown=experiment)
            sweep = read_json(exp_dir / STATE_DIR / SWEEP_FILE)
            if sweep is not None and not sweep_alive(sweep):  # its RUNNING trials stopped with it
                records = [replace(r, status=TrialStatus.PAUSED) if r.status == TrialStatus.RUNNING else r
                           for r in records]
            return ExperimentSnapshot(exp_dir.resolve().name, sweep, records)
    except ExperimentError:
        raise
    except ValueError as e:  # a corrupt sweep or trial-index file
        raise ExperimentError(f"{experiment}: cannot read the experiment: {e}") from None
    except storage_errors() as e:  # remote storage unreachable, or no permission
        raise ExperimentError(cannot(f"read {experiment}", e)) from None


def _alias(record: TrialRecord, labels: dict[str, Any]) -> TrialRecord:
    """The measured trial listed under an equivalent grid point's name, format and precision (one
    measurement, two names)."""
    return replace(record, key=labels["key"], format=labels["format"], precision=labels["precision"],
                   same_as=labels["same_as"],
                   reference=labels.get("reference"))


def stop_detail(stop: dict[str, Any]) -> str:
    """Why the sweep stopped a trial, with the numbers, e.g. `asha: 23 % behind bf16 at step 20`."""
    reason, step = stop["reason"], stop[STEP]
    if "behind" not in stop and "streak" not in stop:  # a stop recorded without its numbers
        return f"{reason} at step {step}"
    if reason == StopReason.BIT_STALL:
        return (f"bit_stall: bit-stall >= {stop['threshold']:g} for {stop['streak']} reports in a row "
                f"(patience {stop['patience']}) at step {step}")
    if "streak" in stop:
        return f"nan: {stop['streak']} non-finite steps in a row (patience {stop['patience']}) at step {step}"
    if stop["behind"] is None:
        return f"nan: val loss non-finite at rung step {step}"
    ref = BASELINE if stop.get("reference_key") else "the rung's best"
    behind, tolerance = _percents(stop["behind"], stop["tolerance"])
    return (f"asha: {behind} % behind {ref} at step {step} ({stop['value']:.4f} vs "
            f"{stop['reference']:.4f}; tolerance {tolerance} %)")


def _percents(a: float, b: float) -> tuple[str, str]:
    """Two fractions as percentages with two significant digits, or as many more as it takes to
    tell them apart: a stop 0.23 % behind under a 0.1 % tolerance must not read "0 % ... 0 %"."""
    for extra in range(5):
        texts = _percent(a, extra), _percent(b, extra)
        if texts[0] != texts[1]:
            break
    return texts


def _percent(fraction: float, extra: int) -> str:
    value = 100 * fraction
    places = max(0, 1 - math.floor(math.log10(abs(value)))) if value else 0
    return f"{value:.{places + extra}f}"


def _stopped(path: Path) -> dict[str, dict[str, Any]]:
    return (read_json(path) or {}).get("stopped", {})


def _record(labels: dict[str, Any], **kw: Any) -> TrialRecord:
    return TrialRecord(
        key=labels["key"], format=labels["format"], optimizer=labels["optimizer"],
        precision=labels["precision"], seed=labels["seed"], params=labels.get("params", {}),
        axes=labels.get("axes", {}), reference=labels.get("reference"), **kw,
    )


def _trial_record(exp_dir: Path, trial_id: str, entry: dict[str, Any], stop: dict[str, Any] | None,
                  shown: str | Path | None) -> TrialRecord:
    trial_dir = exp_dir / TRIALS_DIR / entry["key"]
    if not trial_dir.is_dir():  # remote storage: the trial's files were synced into Ray's dir
        trial_dir = exp_dir / entry["dir"]
    run = trial_dir / RUN_DIR
    try:
        history = _by_step(read_jsonl(run / METRICS_FILE))
        events = read_jsonl(run / EVENTS_FILE)
        summary = read_json(run / SUMMARY_FILE) or {}
        config = read_yaml(run / CONFIG_FILE) if (run / CONFIG_FILE).is_file() else {}  # none: not started
        stability = run_stability(config)
        autocast = summary["autocast"] if "autocast" in summary else run_autocast(config)
        # `QuantConfig.stores_weights_in_format` of the validated config it wrote (which refuses it
        # for bf16), read off the field: validating the section here would import torch
        stored = (config.get("quant") or {}).get("master_weights") == "format"
    except ValueError as e:  # one corrupt trial must not hide the others
        return _record(entry, trial_id=trial_id, status=TrialStatus.ERROR, stop_reason=StopReason.ERROR,
                       trial_dir=trial_dir, unreadable=_as_named(str(e), exp_dir, shown))
    if stop is None:
        return _record(entry, trial_id=trial_id, status=entry["status"], history=history, events=events,
                       summary=summary, trial_dir=trial_dir, error=entry.get("error"), stability=stability,
                       autocast=autocast, stored_in_format=stored)
    step = int(stop[STEP])
    cut = _record(entry, trial_id=trial_id, status=entry["status"], stop_reason=stop["reason"],
                  history=[r for r in history if r[STEP] <= step], events=[e for e in events if e[STEP] <= step],
                  summary=summary, trial_dir=trial_dir, stop_step=step, stop_detail=stop_detail(stop),
                  error=entry.get("error"), stability=stability, autocast=autocast, stored_in_format=stored)
    values = cut.val_series()[1]
    cut.summary = {**summary, "best_val_loss": cut.best_val_loss(upto=step),
                   "final_val_loss": values[-1] if values else math.nan,
                   "status": RunStatus.FINISHED, "stop_reason": stop["reason"], "steps": step}
    return cut


def run_stability(config: dict[str, Any]) -> StabilityConfig:
    """The `stability` settings a run was started with (its config.yaml, read); defaults for a run
    that has not started. Fields this version does not know (a run written by another) are
    ignored, bad values raise."""
    section = config.get("stability") or {}
    return StabilityConfig.model_validate({k: v for k, v in section.items() if k in StabilityConfig.model_fields})


def run_autocast(config: dict[str, Any]) -> bool | None:
    """Whether a run computed its unquantized ops in bf16 autocast, from its config.yaml (read), for
    a run whose summary does not say (written before summaries did, or not started): not on the
    CPU or with autocast off; unknown where the device was chosen at run time."""
    train = config.get("train") or {}
    if train.get("autocast") is False or train.get("device") == "cpu":
        return False
    return True if train.get("device") == "cuda" else None


def _by_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step (the last one written wins), in step order."""
    return sorted({r[STEP]: r for r in rows if STEP in r}.values(), key=lambda r: r[STEP])


def sweep_alive(sweep: dict[str, Any]) -> bool:
    """Whether a sweep (its sweep.json) is running now: so stored, and its driver alive."""
    return sweep.get("status") == SweepStatus.RUNNING and driver_alive(sweep.get("driver", {}))


def driver_alive(driver: dict[str, Any]) -> bool:
    """On this host: its pid exists. On another (a cluster head): its heartbeat is recent."""
    if driver.get("host") != socket.gethostname():
        return time.time() - float(driver.get("beat", 0)) < STALE_S
    try:
        return pid_alive(int(driver["pid"]))
    except (KeyError, ValueError):
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
