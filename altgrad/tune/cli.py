"""The command line every sweep entry point shares (SPEC §7).

`--config`, `--smoke`, `--name`, `--storage-path`, `--resume` | `--fresh`, `--dry-run`,
`--set key=value`. A user-caused problem (bad config, missing data, a sweep that exists with another
config) exits 2 with a message, before anything is written; an interrupted sweep exits 128+signal
after printing the command that resumes it; a sweep with errored trials exits 1.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from altgrad.config import ConfigError
from altgrad.experiment import STALE_S, SweepStatus, sweep_alive
from altgrad.remote import is_remote, join
from altgrad.tune.config import SweepSettings, load_sweep_config
from altgrad.tune.lifecycle import (
    check_movable,
    check_new_location,
    choose_config,
    move_aside,
    stored_sweep,
)
from altgrad.tune.runner import Experiment, run_experiment, start_ray, write_sweep_state


class SweepKind(Protocol):
    kind: str
    script: str
    model: type[SweepSettings]

    @staticmethod
    def experiments(cfg: Any) -> list[Experiment]: ...

    @staticmethod
    def describe(cfg: Any, experiments: list[Experiment]) -> str: ...

    @staticmethod
    def summarize(cfg: Any, experiments: list[Experiment]) -> int: ...


def sweep_parser(description: str, default_config: Path) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", type=Path, help=f"sweep YAML (default: {default_config})")
    p.add_argument("--smoke", action="store_true",
                   help="tiny grid, few steps (the config's smoke: section); the config's name gets '-smoke'")
    p.add_argument("--name", help="experiment name (default: the config's name)")
    p.add_argument("--storage-path", help="where experiments live: a directory or s3://bucket/prefix")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue the experiment of this name with its stored config")
    mode.add_argument("--fresh", action="store_true",
                      help="start over: an existing experiment of this name is moved aside")
    p.add_argument("--dry-run", action="store_true", help="print the grid and its resources, run nothing")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set base.train.max_steps=30 (repeatable)")
    return p


AfterSweep = Callable[[str, str], int]  # (experiment path, sweep name) -> exit code


def sweep_main(kind: SweepKind, default_config: Path, description: str, argv: list[str] | None = None,
               after: AfterSweep | None = None) -> int:
    """Parse, validate, run (or resume) the sweep, print its table; then `after` (e.g. the report,
    which the entry point supplies so that this package does not depend on its readers)."""
    args = sweep_parser(description, default_config).parse_args(argv)
    try:
        return _run(kind, args, default_config, after)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the sweep is stored (data preparation), or in its report
        print("\ninterrupted", file=sys.stderr)
        return 130


def _run(kind: SweepKind, args: argparse.Namespace, default_config: Path, after: AfterSweep | None) -> int:
    from altgrad.data import DataError, prepare_dataset
    from altgrad.tune.wandb_runs import missing_login

    cfg = load_sweep_config(kind.model, args.config or default_config, args.overrides, args.smoke,
                            args.name, args.storage_path)
    experiments = kind.experiments(cfg)  # builds and validates every trial's run config
    mode = "resume" if args.resume else "fresh" if args.fresh else "auto"
    try:
        stored = next((doc for e in experiments if (doc := stored_sweep(e.path))), None)
    except ConfigError as e:  # storage out of reach: a plan of the config file still helps
        if not args.dry_run:
            raise
        print(f"note: could not look for an existing experiment ({e}); planning the config as given",
              file=sys.stderr)
        stored = None
    existing = stored
    if stored is not None:
        _refuse_if_running(stored, cfg.experiment_path)
    if mode == "fresh":
        check_movable(cfg.experiment_path)
        stored = None  # the old experiment is moved aside once everything else has been checked
    if stored is not None:
        explicit = args.config is not None or bool(args.overrides)
        start_over = ("or use another --name" if is_remote(cfg.experiment_path) else
                      "or start over with --fresh (the old one is moved aside), or use another --name")
        doc = choose_config(stored, cfg.model_dump(mode="json"), mode, explicit, start_over)
        try:
            cfg = kind.model.validated(doc)
        except ConfigError as e:
            raise ConfigError(f"the stored config of {cfg.experiment_path} no longer validates: {e}") from None
        experiments = kind.experiments(cfg)
    elif mode == "resume":
        raise ConfigError(f"nothing to resume: no sweep at {cfg.experiment_path} (check --name / --storage-path)")
    elif mode == "auto":
        check_new_location(cfg.experiment_path)
    if args.dry_run:  # what the run would do: an existing experiment's stored config, or its refusal
        _warn(cfg)
        if existing is not None:
            what = ("a run moves it aside and starts over" if mode == "fresh" else
                    "complete: a run prints its trial table and report" if existing.get("status") == SweepStatus.FINISHED
                    else "a run continues it with its stored config")
            print(f"{cfg.experiment_path} exists ({existing.get('status')}): {what}")
        try:
            print(kind.describe(cfg, experiments))
        except DataError as e:  # a measured estimate trains on the data
            raise ConfigError(str(e)) from None
        return 0

    status = {e.path: None if mode == "fresh" else (stored_sweep(e.path) or {}).get("status")
              for e in experiments}
    todo = [e for e in experiments if status[e.path] != SweepStatus.FINISHED]
    if not todo:
        again = ("run it again under another --name (--fresh cannot move an experiment on remote storage)"
                 if is_remote(cfg.experiment_path) else "--fresh starts it over")
        print(f"sweep {cfg.name} is complete ({cfg.experiment_path}); {again}")
        return _finish(kind, cfg, experiments, after)
    if cfg.wandb.enabled and (problem := missing_login(cfg.wandb.mode)):
        raise ConfigError(problem)
    try:
        prepare_dataset(cfg.base_run.data)  # once, before the trials race for it
    except DataError as e:
        raise ConfigError(str(e)) from None
    if mode == "fresh" and (moved := move_aside(cfg.experiment_path)):  # every check has passed
        print(f"moved the previous experiment aside to {moved}")

    command = resume_command(kind, cfg)
    total = sum(e.total_trials for e in experiments)
    resuming = any(status.values())
    _warn(cfg)  # of the config it runs with: a resumed sweep's stored one
    table = experiments[0].path if len(experiments) == 1 else join(cfg.experiment_path, "<format>")
    up_to = "up to " if any(e.search_alg is not None for e in experiments) else ""  # a search may end sooner
    print(f"{'resuming' if resuming else 'starting'} sweep {cfg.name}: {up_to}{total} trial{'s' * (total != 1)} in "
          f"{cfg.experiment_path}\n  trial table, any time: python -m altgrad trials {shlex.quote(table)}")
    # Stored before Ray starts (seconds): a sweep killed during the start-up has one to resume.
    exp = todo[0]
    write_sweep_state(exp, SweepStatus.RUNNING, command)
    errored, outcome, signum = False, None, None
    try:
        start_ray(cfg.dashboard)
        for exp in todo:
            outcome, signum = run_experiment(exp, restore=status[exp.path] is not None, resume_command=command)
            if outcome is SweepStatus.INTERRUPTED:
                break
            errored |= outcome is SweepStatus.ERRORED
    except KeyboardInterrupt:  # outside Tune's own handling: Ray's start-up, a restore
        write_sweep_state(exp, SweepStatus.INTERRUPTED, command)
        outcome, signum = SweepStatus.INTERRUPTED, signal.SIGINT
    if outcome is SweepStatus.INTERRUPTED:
        print(f"\nsweep {cfg.name} interrupted; every trial keeps its checkpoints.\nresume with: {command}",
              flush=True)
        return 128 + int(signum)
    code = _finish(kind, cfg, experiments, after)
    if errored:
        print(f"some trials errored; {command} retries them from their checkpoints")
        return 1
    return code


def _finish(kind: SweepKind, cfg: Any, experiments: list[Experiment], after: AfterSweep | None) -> int:
    """`after` first (the report), then the table, so the table is the last thing on the console."""
    code = after(cfg.experiment_path, cfg.name) if after else 0
    return max(code, kind.summarize(cfg, experiments))


def _warn(cfg: SweepSettings) -> None:
    for warning in cfg.warnings():
        print(f"warning: {warning}", file=sys.stderr)


def _refuse_if_running(stored: dict[str, Any], path: str) -> None:
    driver = stored.get("driver", {})
    if sweep_alive(stored):
        where = "a local copy of it" if is_remote(path) else path
        raise ConfigError(
            f"sweep {path} is running right now (driver pid {driver.get('pid')} on "
            f"{driver.get('host')}); watch it with `python -m altgrad trials` on {where}. A driver "
            f"on another machine counts as gone {STALE_S:.0f} s after its last heartbeat"
        )


def resume_command(kind: SweepKind, cfg: SweepSettings) -> str:
    """The exact command that continues this sweep (its config is stored with it)."""
    python = Path(sys.executable)
    try:
        python_arg = str(python.relative_to(Path.cwd()))
    except ValueError:
        python_arg = "python"
    script = sys.argv[0] if Path(sys.argv[0]).name == Path(kind.script).name else kind.script
    return shlex.join([python_arg, script, "--name", cfg.name, "--storage-path", cfg.storage_path,
                       "--resume"])

