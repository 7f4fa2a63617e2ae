"""What the sweep tests share: the sweep entry points on the shipped configs (`ablation`,
`dry_run`), the overrides of a tiny three-trial sweep and of a tiny lr search, and drivers run as
subprocesses (joining a Ray cluster, or on a Ray of their own as if on another machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from altgrad.experiment import RUN_DIR, TRIALS_DIR, read_jsonl
from altgrad.tune.ablation import FormatAblation
from altgrad.tune.cli import sweep_main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "sweeps" / "format_ablation.py"
ABLATION = ROOT / "sweeps" / "configs" / "format_ablation.yaml"
LR_SEARCH = ROOT / "sweeps" / "configs" / "lr_search.yaml"
CPU_STUDY = ROOT / "sweeps" / "configs" / "cpu_study.yaml"
STEPS, CHECKPOINT = 20, 5
# The environment of every Ray node the sweep tests start, and so of their trial processes: the
# quantizer kernels run eagerly. Each trial process would otherwise compile them afresh (seconds
# to a minute each on a cold cache); the sweep tests are about orchestration, and the eager and
# compiled kernels are bit-identical (test_quantize, test_linear, test_codes).
TRIALS_ENV = {"ALTGRAD_NO_COMPILE": "1"}


def ablation(*args: str) -> int:
    """`sweeps/format_ablation.py ARGS` in this process, on the shipped config; its exit code."""
    return sweep_main(FormatAblation, ABLATION, "test", list(args))


def dry_run(capsys, *args: str, kind=FormatAblation, config=ABLATION) -> str:
    """What `--dry-run ARGS` prints (it must exit 0)."""
    assert sweep_main(kind, config, "test", ["--dry-run", *args]) == 0
    return capsys.readouterr().out


def tiny_sweep(eurlex_dir: Path, data_root: Path) -> list[str]:
    """bf16, e4m3 and e7m0 (at a learning rate it cannot take) on a tiny model, one trial at a
    time, STEPS steps with a checkpoint every CHECKPOINT."""
    sets = [
        "preset=cpu", "grid.formats=[bf16, e4m3, e7m0]", "grid.optimizers=[adamw]", "grid.precisions=[all]",
        "grid.seeds=[42]",
        "grid.format_overrides={e7m0: {optim: {lr: 1000}}}",
        f"base.data.source=jsonl:{eurlex_dir}", f"base.data.data_root={data_root}", "base.data.max_docs=40",
        "base.model={n_layer: 1, n_head: 2, n_embd: 32, block_size: 16}", "base.train.batch_size=2",
        f"base.train.max_steps={STEPS}", "base.train.warmup_steps=2", "base.train.eval_interval=5",
        f"base.train.checkpoint_interval={CHECKPOINT}", "base.train.eval_iters=2",
        "base.train.diag_every=5", "base.train.shadow_every=5",
        "asha.grace_period=10", "base.stability.nan_patience=3", "max_concurrent_trials=1",
        "wandb.enabled=false", "dashboard.enabled=false",
    ]
    return [arg for s in sets for arg in ("--set", s)]


def tiny_lr_search(eurlex_dir: Path, data_root: Path, *sets: str) -> list[str]:
    """An lr search of e4m3 on a tiny model: the grid 0.01 (learns) and 1000 (diverges), then one
    Optuna sample in [0.001, 1000]; 10 steps with a checkpoint every 5; W&B and the dashboard off;
    `sets` on top."""
    base = [
        "preset=cpu", "formats=[e4m3]", "lr={grid: [0.01, 1000.0], low: 0.001, high: 1000.0, samples: 1}",
        f"base.data.source=jsonl:{eurlex_dir}", f"base.data.data_root={data_root}", "base.data.max_docs=40",
        "base.model={n_layer: 1, n_head: 2, n_embd: 32, block_size: 16}", "base.train.batch_size=2",
        "base.train.max_steps=10", "base.train.warmup_steps=2", "base.train.eval_interval=5",
        "base.train.checkpoint_interval=5", "base.train.eval_iters=2", "base.train.diag_every=5",
        "base.stability.nan_patience=3", "wandb.enabled=false", "dashboard.enabled=false",
    ]
    return [arg for s in (*base, *sets) for arg in ("--set", s)]


def start_driver(args: list[str], ray_address: str | None, machine: Path | None = None) -> subprocess.Popen:
    """A driver joining the session's Ray; or, with `machine` (a folder standing for a machine's
    disk: its working directory, home and Ray's temp dir), on a Ray of its own, in its own process
    group."""
    env = {**os.environ, "RAY_ADDRESS": ray_address} if ray_address else {
        k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cwd = ROOT
    if machine is not None:
        for sub in ("work", "home", "ray"):
            (machine / sub).mkdir(parents=True)
        env.update(HOME=str(machine / "home"), RAY_TMPDIR=str(machine / "ray"), **TRIALS_ENV)
        cwd = machine / "work"
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=cwd, text=True, env=env,
                            start_new_session=machine is not None,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until `condition()` holds; fails if the driver exits first or `timeout` seconds pass. The
    timeout is generous: the other test worker compiles beside the sweep, and the first ASHA rung
    of a test that takes ~70 s in all took over 120 s to appear under extra load."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the driver exited ({proc.returncode}) early:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("timed out waiting for the sweep")
        time.sleep(0.2)


def last_step(exp: Path, key: str) -> int:
    """The newest step a trial has logged (0 if it has not started)."""
    rows = read_jsonl(exp / TRIALS_DIR / key / RUN_DIR / "metrics.jsonl")
    return int(rows[-1]["step"]) if rows else 0




def kill_processes_mentioning(path: str | Path) -> None:
    """SIGKILL every process whose command line names `path` (a Ray node's temp dir or session
    folder: its GCS, raylet and workers), as when its machine disappears."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        if str(path) in " ".join(p.info["cmdline"] or []):
            p.kill()


def pickle_roundtrip(obj):
    """What Tuner.restore does to a scheduler or stopper: pickled with tuner.pkl, read back."""
    import pickle

    return pickle.loads(pickle.dumps(obj))
