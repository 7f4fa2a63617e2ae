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

from altgrad.config import ConfigError, config_diff
from altgrad.experiment import STATE_DIR, SWEEP_FILE
from altgrad.remote import cannot, is_remote, storage_errors
from altgrad.tune.config import MOVED_STOPPER_KEYS, SweepSettings, absolute_data_paths
from altgrad.tune.store import StateStore

# Settings that may change between a run and its resume: where it is and how it is watched.
NOT_COMPARED = ("storage_path", "dashboard", "smoke")


def stored_sweep(experiment_path: str) -> dict[str, Any] | None:
    """The `sweep.json` of an experiment, or None when there is none; a config stored before a
    setting moved has it where it is now (`upgraded_config`), so an older sweep still resumes."""
    try:
        doc = StateStore(experiment_path, patient=False).read(SWEEP_FILE)
    except storage_errors() as e:  # remote storage unreachable, or no permission
        raise ConfigError(cannot(f"read {experiment_path}", e)) from None
    except ValueError as e:  # not JSON: nothing says whether it runs, or with what config
        raise ConfigError(f"{experiment_path}: its {STATE_DIR}/{SWEEP_FILE} is corrupt ({e}); move the "
                          "experiment aside by hand, or choose another --name") from None
    if doc is not None and isinstance(doc.get("config"), dict):
        doc["config"] = upgraded_config(doc["config"])
    return doc


def upgraded_config(config: dict[str, Any]) -> dict[str, Any]:
    """A stored sweep config in the form a config is loaded in now.

    - Its `base` data paths absolute (`absolute_data_paths`, as `load_sweep_config` makes them),
      relative ones (stored by an older version) resolved where they name data (`data_base`).
    - The stopper's thresholds moved to the run settings that replaced them (`MOVED_STOPPER_KEYS`).
      A threshold the stopper set was the one that ended its trials, so it wins over the run's own;
      unset (None), the run's stays. A config file given by the user is not upgraded: it is refused
      with the new place named."""
    if isinstance(config.get("base"), dict):
        config = {**config, "base": absolute_data_paths(config["base"], data_base(config))}
    stopper = config.get("stopper")
    if not isinstance(stopper, dict) or not set(stopper) & set(MOVED_STOPPER_KEYS):
        return config
    base = copy.deepcopy(config.get("base") or {})
    stability = base.setdefault("stability", {})
    for key, moved_to in MOVED_STOPPER_KEYS.items():
        if key in stopper and stopper[key] is not None:
            stability[moved_to.rsplit(".", 1)[1]] = stopper[key]
    return {**config, "base": base, "stopper": {k: v for k, v in stopper.items() if k not in MOVED_STOPPER_KEYS}}


def data_base(config: dict[str, Any]) -> Path:
    """The directory the relative data paths of a stored sweep's `base` (an older version's) are
    read from: the current one, as they always were, where its data is; else, where it is not, the
    directory the sweep was likely started in (`started_in`), if the data is there. A resume from
    elsewhere then finds the data the sweep started with where it had failed on a path that meant
    nothing. With data of that name here too, it is this directory's that is read: the likely start
    is a guess, and the current directory was the rule these sweeps were stored under. Data in
    neither fails naming the folder looked for here (`prepare_dataset`)."""
    here, started = Path.cwd(), started_in(config)
    if started != here and not _has_data(config["base"], here) and _has_data(config["base"], started):
        return started
    return here


def started_in(config: dict[str, Any]) -> Path:
    """Where a stored sweep was likely started: its `storage_path` was stored resolved there, so
    when that is the default folder (`experiments`), its parent; else the current directory. A
    guess (`--storage-path /x/experiments` names a folder of that name anywhere), so `data_base`
    takes it only where the data is."""
    storage, default = config.get("storage_path"), SweepSettings.model_fields["storage_path"].default
    if isinstance(storage, str) and not is_remote(storage) and Path(storage).is_absolute() \
            and Path(storage).name == default:
        return Path(storage).parent
    return Path.cwd()


def _has_data(base: dict[str, Any], directory: Path) -> bool:
    """Whether a sweep's `base` read from `directory` names data that is there: its jsonl folder,
    or for another source the prepared data's root."""
    data = absolute_data_paths(base, directory).get("data")
    if not isinstance(data, dict):  # not a data section: left to validation, which names it
        return False
    source = data.get("source")
    if isinstance(source, str) and source.startswith("jsonl:"):
        return Path(source.removeprefix("jsonl:")).is_dir()
    return isinstance(data.get("data_root"), str) and Path(data["data_root"]).is_dir()


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in NOT_COMPARED}


def choose_config(stored: dict[str, Any], config: dict[str, Any], mode: str, explicit: bool,
                  how_to_start_over: str) -> dict[str, Any]:
    """The config an existing experiment continues with: its own; a changed one is refused. Where
    it is now is `config`'s; how it is watched (`NOT_COMPARED`) too where the user said it anew
    (`explicit`: a --config or --set), else its own: a bare --resume loads the default config file,
    whose dashboard and smoke settings are not the sweep's."""
    diff = config_diff(comparable(stored["config"]), comparable(config))
    if diff and (mode == "auto" or explicit):
        shown = "\n  ".join(diff[:12]) + ("\n  ..." if len(diff) > 12 else "")
        raise ConfigError(
            f"experiment {config['name']} already exists with a different config:\n  {shown}\n"
            f"Continue it with its own config: --resume (without --config/--set); {how_to_start_over}"
        )
    taken = NOT_COMPARED if explicit else ("storage_path",)
    return {**stored["config"], **{k: config[k] for k in taken if k in config}}


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
