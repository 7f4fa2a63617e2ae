"""A lost spot worker: a 2-node Ray cluster on this machine (`ray start` twice: the head, and a
worker node), shared storage, a sweep with a trial on each node. The
worker node is killed (SIGKILL to all of its processes, no graceful shutdown) after its trial has
checkpointed; Ray retries that trial on the surviving node from its last checkpoint."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from sweep_helpers import (
    CHECKPOINT,
    STEPS,
    TRIALS_ENV,
    kill_processes_mentioning,
    last_step,
    start_driver,
    wait_for,
)

from altgrad.experiment import STATE_DIR, TRIALS_DIR, TRIALS_FILE, WORKER_FILE, load_experiment

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = str(Path(sys.executable).parent / "ray")
# The head declares a node dead after 3 missed health checks 0.5 s apart (Ray's default: ~15 s).
FAST_HEALTH_CHECK = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3"}
# Long enough that the worker node's trial is still running when the test sees it past its first
# checkpoint: at the sweep tests' STEPS an eager tiny trial ends within a second of that point.
RUN_STEPS = 6 * STEPS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster(monkeypatch):
    """(head address, the worker node's `ray start --block` process): one CPU each, token auth on
    with one token for the nodes and the driver, as on a real cluster."""
    temp = tempfile.mkdtemp(prefix="altgrad-")  # short: Ray's socket paths must fit 107 bytes
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(16))
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **FAST_HEALTH_CHECK, **TRIALS_ENV}
    address = f"127.0.0.1:{free_port()}"
    subprocess.run([RAY, "start", "--head", f"--port={address.split(':')[1]}", "--node-ip-address=127.0.0.1",
                    "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
                   env=env, check=True, capture_output=True)
    worker = subprocess.Popen([RAY, "start", f"--address={address}", "--node-ip-address=127.0.0.1",
                               "--num-cpus=1", "--block"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield address, worker
    if worker.poll() is None:
        worker.kill()
    kill_processes_mentioning(temp)  # the head (not `ray stop`: it would stop every Ray here)
    shutil.rmtree(temp, ignore_errors=True)


def test_lost_worker_node_trial_resumes_on_the_survivor(cluster, sweep_args, tmp_path):
    address, worker = cluster
    args = [*sweep_args, "--set", "grid.formats=[bf16, e4m3]", "--set", "max_concurrent_trials=2",
            "--set", f"base.train.max_steps={RUN_STEPS}", "--set", "asha.enabled=false",
            "--name", "spot", "--storage-path", str(tmp_path)]
    exp = tmp_path / "spot"
    proc = start_driver(args, address)

    def node_processes() -> list[psutil.Process]:
        """The worker node: `ray start --block` and everything it started (raylet, workers)."""
        start = psutil.Process(worker.pid)
        return [start, *start.children(recursive=True)]

    def on_worker_node() -> str | None:
        """The key of a trial running in one of the worker node's processes, once it is past its
        first checkpoint."""
        pids = {p.pid for p in node_processes()}
        for key in ("bf16-adamw-all-s42", "e4m3-adamw-all-s42"):
            path = exp / TRIALS_DIR / key / WORKER_FILE
            try:
                if json.loads(path.read_text())["pid"] in pids and last_step(exp, key) >= CHECKPOINT + 2:
                    return key
            except (FileNotFoundError, json.JSONDecodeError):
                continue
        return None

    wait_for(lambda: on_worker_node() is not None, proc)
    key = on_worker_node()
    lost = json.loads((exp / TRIALS_DIR / key / WORKER_FILE).read_text())
    for p in node_processes():  # the raylet, its workers, the trial: all at once, no shutdown
        p.kill()
    killed_at = last_step(exp, key)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]

    with pytest.raises(ProcessLookupError):
        os.kill(lost["pid"], 0)
    records = {r.key: r for r in load_experiment(exp)}
    assert all((r.status, r.stop_reason, r.summary["steps"]) == ("TERMINATED", "completed", RUN_STEPS)
               for r in records.values())
    retried = json.loads((exp / TRIALS_DIR / key / WORKER_FILE).read_text())
    assert retried["node"] != lost["node"]  # the survivor ran the retry
    (resumed_from,) = [e["step"] for e in records[key].events if e["kind"] == "resume"]
    assert resumed_from > 0 and killed_at - resumed_from <= CHECKPOINT  # at most one interval redone
    steps = [row["step"] for row in records[key].history]
    assert steps == list(range(1, RUN_STEPS + 1))  # nothing lost, nothing logged twice
    (entry,) = [e for e in json.loads((exp / STATE_DIR / TRIALS_FILE).read_text()).values() if e["key"] == key]
    assert entry["failures"] == 1
