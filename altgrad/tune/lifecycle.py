"""Whether a sweep starts new, resumes, or is already done; and moving an old one aside.

Re-running a sweep under the same name continues it when its config is unchanged (a spot instance
that was lost, a Ctrl-C), and refuses with the differences listed when it changed: silently mixing
two configs in one experiment would make its table meaningless. `--fresh` moves the old experiment
aside (never deletes it).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from altgrad.config import ConfigError
from altgrad.experiment import STATE_DIR, SWEEP_FILE
from altgrad.remote import cannot_read, is_remote, storage_errors
from altgrad.tune.config import MOVED_STOPPER_KEYS, SweepSettings, absolute_data_paths
from altgrad.tune.store import StateStore

# Settings that may change between a run and its resume: where it is and how it is watched.
NOT_COMPARED = ("storage_path", "dashboard", "smoke")


def stored_sweep(experiment_path: str) -> dict[str, Any] | None:
    """The `sweep.json` of an experiment, or None when there is none; a config stored before a
    setting moved has it where it is now (`upgraded_config`), so an older sweep still resumes."""
    try:
        doc = StateStore(experiment_path).read(SWEEP_FILE)
    except storage_errors() as e:  # remote storage unreachable, or no permission
        raise ConfigError(cannot_read(experiment_path, e)) from None
    except ValueError as e:  # not JSON: nothing says whether it runs, or with what config
        raise ConfigError(f"{experiment_path}: its {STATE_DIR}/{SWEEP_FILE} is corrupt ({e}); move the "
                          "experiment aside by hand, or choose another --name") from None
    if doc is not None and isinstance(doc.get("config"), dict):
        doc["config"] = upgraded_config(doc["config"])
    return doc


def upgraded_config(config: dict[str, Any]) -> dict[str, Any]:
    """A stored sweep config in the form a config is loaded in now.

    - Its `base` data paths absolute (`absolute_data_paths`, as `load_sweep_config` makes them),
      relative ones resolved where the sweep was started (`started_in`): there they match the
      config loaded again, and a `--resume` from elsewhere trains on the same data.
    - The stopper's thresholds moved to the run settings that replaced them (`MOVED_STOPPER_KEYS`).
      A threshold the stopper set was the one that ended its trials, so it wins over the run's own;
      unset (None), the run's stays. A config file given by the user is not upgraded: it is refused
      with the new place named."""
    if isinstance(config.get("base"), dict):
        config = {**config, "base": absolute_data_paths(config["base"], started_in(config))}
    stopper = config.get("stopper")
    if not isinstance(stopper, dict) or not set(stopper) & set(MOVED_STOPPER_KEYS):
        return config
    base = copy.deepcopy(config.get("base") or {})
    stability = base.setdefault("stability", {})
    for key, moved_to in MOVED_STOPPER_KEYS.items():
        if key in stopper and stopper[key] is not None:
            stability[moved_to.rsplit(".", 1)[1]] = stopper[key]
    return {**config, "base": base, "stopper": {k: v for k, v in stopper.items() if k not in MOVED_STOPPER_KEYS}}


def started_in(config: dict[str, Any]) -> Path:
    """The directory a stored sweep was started from, against which the relative data paths an
    older version stored were meant. Its `storage_path` was stored resolved there: when that is the
    default folder (`experiments`), its parent is that directory. Otherwise nothing recorded says,
    and the current directory is taken (a resume from elsewhere then fails naming the data folder
    it looked for: `prepare_dataset`)."""
    storage, default = config.get("storage_path"), SweepSettings.model_fields["storage_path"].default
    if isinstance(storage, str) and not is_remote(storage) and Path(storage).is_absolute() \
            and Path(storage).name == default:
        return Path(storage).parent
    return Path.cwd()


def config_diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two config documents differ, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for key in sorted(set(old) | set(new), key=str)
                for line in config_diff(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in NOT_COMPARED}


def choose_config(stored: dict[str, Any], config: dict[str, Any], mode: str, explicit: bool,
                  how_to_start_over: str) -> dict[str, Any]:
    """The config an existing experiment continues with: its own; a changed one is refused."""
    diff = config_diff(comparable(stored["config"]), comparable(config))
    if diff and (mode == "auto" or explicit):
        shown = "\n  ".join(diff[:12]) + ("\n  ..." if len(diff) > 12 else "")
        raise ConfigError(
            f"experiment {config['name']} already exists with a different config:\n  {shown}\n"
            f"Continue it with its own config: --resume (without --config/--set); {how_to_start_over}"
        )
    return {**stored["config"], **{k: config[k] for k in NOT_COMPARED if k in config}}


def check_new_location(experiment_path: str) -> None:
    """A new experiment may not land on a directory that holds something else."""
    path = Path(experiment_path)
    if not is_remote(experiment_path) and path.exists() and any(path.iterdir()) \
            and not (path / STATE_DIR).exists():
        raise ConfigError(
            f"{path} exists and is not an AltGrad experiment; choose another --name or "
            "--storage-path, or pass --fresh to move it aside"
        )


def check_movable(experiment_path: str) -> None:
    """`--fresh` renames the old experiment: a local directory can be renamed, an object store's
    prefix cannot (a copy of every object would be a rename that can fail halfway)."""
    if is_remote(experiment_path):
        raise ConfigError(
            f"--fresh cannot move {experiment_path} on remote storage; move or delete it with your "
            "storage tools, or choose another --name"
        )


def move_aside(experiment_path: str) -> Path | None:
    """Rename an existing experiment directory to `<name>.old-<time>`; returns the new path."""
    check_movable(experiment_path)
    path = Path(experiment_path)
    if not path.exists():
        return None
    target = path.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    path.rename(target)
    return target
