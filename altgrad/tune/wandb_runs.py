"""W&B: one run per trial, created in the trial's own process; offline by default.

Nothing runs on the driver (no logging actors, no stalls at trial start). The run id is derived
from the experiment and the trial's grid key, so every attempt at a trial -- a retry after a crash,
a resume after the driver was killed -- logs into the same run, and its history holds each step
once. An attempt starts after the last step the run really holds: what its local files under the
trial directory hold (`wandb_files`), or what `<run dir>/wandb.json` says a finished attempt
logged (for a retry on another machine, where only the run directory is fetched). A killed attempt
can lose rows W&B had not written yet; the trainable logs them again from the run directory's
`metrics.jsonl` before the resumed training reports (`TuneReporter`). Offline, each attempt
writes an `offline-run-*` folder under the trial directory; `wandb sync` merges them by id.

Stability events (non-finite steps, a NaN stop, format shifts, overflow / underflow / bit-stall /
kurtosis warnings, divergence) become W&B alerts, at most one per kind every ALERT_COOLDOWN_S: a
NaN streak is one alert, not one per step (W&B's own `wait_duration` applies only online).
"""

from __future__ import annotations

import hashlib
import json
import logging
import netrc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from altgrad.experiment import WANDB_STATE_FILE, EventKind
from altgrad.metrics import STEP

log = logging.getLogger(__name__)

ALERT_COOLDOWN_S = 300
ALERT_LEVELS = {EventKind.NAN_SKIP: "WARN", EventKind.NAN_STOP: "ERROR", EventKind.FORMAT_SHIFT: "WARN",
                EventKind.DIVERGENCE_WARN: "WARN", EventKind.BIT_STALL_WARN: "WARN",
                EventKind.OVERFLOW_WARN: "WARN", EventKind.UNDERFLOW_WARN: "WARN",
                EventKind.KURTOSIS_WARN: "INFO"}  # the other kinds are bookkeeping, not alerts


@dataclass(frozen=True)
class WandbSpec:
    """Where a sweep's trials log: the W&B project, the mode, the group (the experiment's name) and
    what tells this sweep apart from any other (its path and start time)."""

    project: str
    mode: str
    group: str
    sweep_id: str


def missing_login(mode: str) -> str | None:
    """Why an online sweep's trials could not log (no API key on this machine), else None: said
    once by the driver before any trial starts, rather than by every trial failing at `wandb.init`."""
    if mode != "online" or os.environ.get("WANDB_API_KEY"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc().authenticators(host):  # where `wandb login` keeps the key
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (f"wandb.mode=online needs a W&B API key for {host} on this machine: run `wandb login` or "
            "set WANDB_API_KEY; or log offline (wandb.mode=offline) and `wandb sync` the trial "
            "directories later")


def run_id(sweep_id: str, key: str) -> str:
    """The W&B run id of a trial: the same for every attempt at it, another in any other sweep."""
    return hashlib.sha1(f"{sweep_id}/{key}".encode()).hexdigest()[:16]


class TrialRun:
    """A trial's W&B run: `log` each reported row, `event` each stability event, `finish`."""

    def __init__(self, spec: WandbSpec, key: str, config: dict[str, Any], run_dir: Path, trial_dir: Path):
        import wandb

        from altgrad.tune.wandb_files import last_logged_step

        self.id = run_id(spec.sweep_id, key)
        self.state_file = run_dir / WANDB_STATE_FILE
        state = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        self.last_step = max(int(state.get("last_step", 0)), last_logged_step(trial_dir, self.id))
        self.run = wandb.init(project=spec.project, group=spec.group, name=key, id=self.id, resume="allow",
                              mode=spec.mode, dir=str(trial_dir), config=config, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))
        self.alerted: dict[str, float] = {}

    def log(self, row: dict[str, float]) -> None:
        step = int(row[STEP])
        if step <= self.last_step:  # logged by an earlier attempt
            return
        # committed now, not when the next step arrives: a stopped or killed trial keeps its last row
        self.run.log({k: v for k, v in row.items() if k != STEP}, step=step, commit=True)
        self.last_step = step

    def event(self, event: dict[str, Any]) -> None:
        """An alert for a stability event, unless its kind alerted less than the cooldown ago or
        its step was logged by an earlier attempt."""
        level = ALERT_LEVELS.get(event["kind"])
        now = time.monotonic()
        if level is None or event[STEP] <= self.last_step or \
                now - self.alerted.get(event["kind"], -ALERT_COOLDOWN_S) < ALERT_COOLDOWN_S:
            return
        self.alerted[event["kind"]] = now
        self.run.alert(title=f"{self.run.name}: {event['kind']}", text=f"step {event[STEP]}: {event['message']}",
                       level=level, wait_duration=ALERT_COOLDOWN_S)

    def finish(self, exit_code: int = 0) -> None:
        """Close the run and W&B's service process (a trial process outlives its trial when Ray
        reuses it; left running, the service is torn down at exit after Ray's, with a traceback)."""
        import wandb

        self.run.finish(exit_code=exit_code)  # returns once every row is in the run's files
        self.state_file.write_text(json.dumps({"run_id": self.id, "last_step": self.last_step}))
        try:
            wandb.teardown()
        except SystemExit as e:  # W&B exits the process when its service died (Ray may kill it)
            log.warning("W&B service of run %s had already exited (code %s)", self.id, e.code)


@contextmanager
def trial_run(spec: WandbSpec | None, key: str, config: dict[str, Any], run_dir: Path,
              trial_dir: Path) -> Iterator[TrialRun | None]:
    """The trial's W&B run (None when W&B is off), finished however the trial ends: Tune stops a
    trial by raising SystemExit(0) in it, which is not a failure. W&B never fails a trial: a run
    that cannot be finished (Ray may kill a stopped trial's process, W&B's service with it) is
    logged and left; the run directory holds the record."""
    if spec is None:
        yield None
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    run = TrialRun(spec, key, config, run_dir, trial_dir)
    code = 0
    try:
        yield run
    except BaseException as e:
        code = 0 if isinstance(e, SystemExit) and not e.code else 1
        raise
    finally:
        try:
            run.finish(exit_code=code)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning("W&B run %s not finished cleanly: %s: %s", run.id, type(e).__name__, e)
