"""Checkpoints: one dict per checkpoint, written atomically, retained as best + last N.

Layout: `<run_dir>/checkpoints/step_XXXXXXXX/checkpoint.pt` (a directory per checkpoint so the
Tune adapter can hand it to `tune.Checkpoint.from_directory` as is) and `anomaly_step_XXXXXXXX/`
for the pre-step state at the first NaN of a streak. Beside each `checkpoint.pt`, `meta.json` holds
its step and val loss, written in the same atomic rename; `best.json` names the best checkpoint,
rewritten from those after every save: a writer killed between the two files, or a corrupt
`best.json`, cannot make the retention prune the best.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from altgrad.experiment import BEST_FILE, CHECKPOINT_FILE, CHECKPOINTS_DIR, pid_alive

META_FILE = "meta.json"  # beside checkpoint.pt: {"step", "val_loss"}, what ranks it for `best.json`
STEP_PREFIX = "step_"
ANOMALY_PREFIX = "anomaly_step_"
WRITING = ".tmp-"  # a checkpoint being written: `.<name>.tmp-<writer's pid>`, renamed when whole


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, truncated, corrupt); the message names the file."""


def checkpoint_name(step: int, prefix: str = STEP_PREFIX) -> str:
    return f"{prefix}{step:08d}"


def save_checkpoint(directory: Path, state: dict[str, Any], meta: dict[str, Any] | None = None) -> Path:
    """Write `state` to `directory/checkpoint.pt` (and `meta`, if given, to its `meta.json`)
    atomically: a killed writer leaves no torn file, only its temporary folder (`orphaned_writes`)."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}{WRITING}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / CHECKPOINT_FILE, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if meta is not None:
        (tmp / META_FILE).write_text(json.dumps(meta))
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint (its directory or file) with `weights_only=True`."""
    path = Path(path)
    file = path / CHECKPOINT_FILE if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"checkpoint not found: {file}")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a truncated / corrupt file
        raise CheckpointError(f"checkpoint {file} is corrupt or truncated ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or "step" not in state or "model" not in state:
        raise CheckpointError(f"checkpoint {file} is not an AltGrad checkpoint (no step/model)")
    return state


def orphaned_writes(ckpt_root: Path) -> list[Path]:
    """The temporary folders of checkpoint writers on this host that are gone (killed mid-write,
    a spot instance's kill -9): each holds a checkpoint's worth of disk that nothing will rename."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.glob(f".*{WRITING}*"):
        pid = p.name.rsplit(WRITING, 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            found.append(p)
    return sorted(found)


def step_checkpoints(ckpt_root: Path) -> list[Path]:
    """Regular checkpoint directories, oldest first."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX))


def resume_candidates(path: Path) -> list[Path]:
    """Checkpoints to try for `--resume PATH`, preferred first.

    PATH may be a run dir (its newest checkpoint), a checkpoints dir, or one checkpoint; in every
    case older checkpoints of the same run follow as fall-backs for a corrupt newest one.
    """
    path = Path(path)
    if (path / CHECKPOINTS_DIR).is_dir():
        path = path / CHECKPOINTS_DIR
    if path.is_file():
        path = path.parent
    if path.name.startswith((STEP_PREFIX, ANOMALY_PREFIX)) or (path / CHECKPOINT_FILE).is_file():
        older = [p for p in step_checkpoints(path.parent) if p.name < path.name]
        return [path, *reversed(older)]
    return list(reversed(step_checkpoints(path)))


class CheckpointManager:
    """Writes checkpoints under `<run_dir>/checkpoints` and keeps the best one plus the last N."""

    def __init__(self, run_dir: Path, keep_last: int):
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.keep_last = keep_last

    @property
    def best_file(self) -> Path:
        return self.root / BEST_FILE

    def best(self) -> dict[str, Any] | None:
        """`{"name", "step", "val_loss"}` of the checkpoint with the lowest val loss (the earliest of
        equal ones; NaN, no evaluation yet, never), from the checkpoints' own `meta.json`; one
        written before they had it counts by `best.json`'s entry, if that names it."""
        ranked = []
        for p in step_checkpoints(self.root):
            meta = _read_json(p / META_FILE)
            if meta is not None:
                ranked.append({**meta, "name": p.name})
        named = _read_json(self.best_file)
        if (named is not None and (self.root / str(named.get("name"))).is_dir()
                and all(m["name"] != named["name"] for m in ranked)):
            ranked.append(named)
        ranked = [m for m in ranked if isinstance(m.get("step"), int) and isinstance(m.get("val_loss"), float | int)
                  and not math.isnan(m["val_loss"])]  # (an entry written otherwise ranks nothing)
        return min(ranked, key=lambda m: (m["val_loss"], m["name"]), default=None)

    def save(self, step: int, state: dict[str, Any], val_loss: float | None) -> Path:
        """Write the checkpoint of `step`, whose last evaluation's loss is `val_loss` (None or NaN:
        none yet), name the best in `best.json` and prune to the best and the last N."""
        directory = save_checkpoint(self.root / checkpoint_name(step), state, {"step": step, "val_loss": val_loss})
        best = self.best()
        if best is not None:
            tmp = self.best_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"name": best["name"], "step": best["step"], "val_loss": best["val_loss"]}))
            os.replace(tmp, self.best_file)
        self._prune(best)
        return directory

    def save_anomaly(self, step: int, state: dict[str, Any]) -> Path:
        return save_checkpoint(self.root / checkpoint_name(step, ANOMALY_PREFIX), state)

    def _prune(self, best: dict[str, Any] | None) -> None:
        keep = {p.name for p in step_checkpoints(self.root)[-self.keep_last :]}
        if best:
            keep.add(best["name"])
        for p in step_checkpoints(self.root):
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)
        for p in orphaned_writes(self.root):
            shutil.rmtree(p, ignore_errors=True)


def _read_json(path: Path) -> dict[str, Any] | None:
    """A small JSON object of the checkpoints' own, or None where it is missing or corrupt (a
    torn write: the files it summarizes are still there to rank)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
