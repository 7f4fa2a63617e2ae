"""The sweep driver's Ray and signals (`altgrad.tune.runner`): SIGTERM takes Ray's graceful SIGINT
path, and the dashboard `start_ray` starts listens on 127.0.0.1 only, behind Ray's token
authentication (401 without the token). For the dashboard Ray runs in a subprocess with its own
home, so its token is generated fresh there."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from altgrad.experiment import STATE_DIR, SWEEP_FILE, SweepStatus, read_json
from altgrad.tune import runner
from altgrad.tune.config import DashboardSettings, SweepConfig, load_sweep_config
from altgrad.tune.runner import Experiment, sigterm_stops_gracefully, write_sweep_state

ROOT = Path(__file__).resolve().parents[1]


def test_sigterm_takes_the_sigint_path():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda *a: seen.append("sigint"))
    try:
        with sigterm_stops_gracefully() as received:
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert received == [signal.SIGTERM] and seen == ["sigint"]


START = """
import sys
from altgrad.tune.config import DashboardSettings
from altgrad.tune.runner import start_ray
start_ray(DashboardSettings(port=int(sys.argv[1])))
print("ready", flush=True)
sys.stdin.read()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_address() -> str:
    """This machine's address on its network (what another machine would connect to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]


def get(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.ray
@pytest.mark.slow
def test_dashboard_listens_on_loopback_behind_the_token(request):
    port = free_port()
    home = Path(tempfile.mkdtemp(prefix="altgrad-"))  # short: Ray's socket paths must fit 107 bytes
    request.addfinalizer(lambda: shutil.rmtree(home, ignore_errors=True))
    env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE")},
           "HOME": str(home), "RAY_TMPDIR": str(home)}
    proc = subprocess.Popen([sys.executable, "-c", START, str(port)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        lines = iter(proc.stdout.readline, "")
        assert any("ready" in line for line in lines), "start_ray did not come up"
        url = f"http://127.0.0.1:{port}/api/version"
        deadline = time.monotonic() + 60
        while get(url) not in (200, 401) and time.monotonic() < deadline:
            time.sleep(0.5)
        token = (home / ".ray" / "auth_token").read_text().strip()  # what `ray get-auth-token` prints
        assert get(url) == 401
        assert get(url, token="not-the-token") in (401, 403)
        assert get(url, token=token) == 200
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):  # not on the network
            s.settimeout(5)
            s.connect((machine_address(), port))
    finally:
        proc.stdin.close()  # the driver exits, and its Ray with it
        proc.wait(timeout=60)


def test_sweep_json_keeps_the_code_the_sweep_started_with_and_lists_every_drivers(tmp_path, monkeypatch):
    """A sweep resumed after a commit ran two codes: `commit` stays the first, `commits` names both
    (each trial's worker.json names its own)."""
    settings = load_sweep_config(SweepConfig, ROOT / "sweeps" / "configs" / "format_ablation.yaml", smoke=True,
                                 name="x", storage_path=str(tmp_path))
    exp = Experiment(settings, "format_ablation", str(tmp_path / "x"), {}, {}, [], 1)
    for commit, status in (("aaa1111", SweepStatus.RUNNING), ("aaa1111", SweepStatus.INTERRUPTED),
                           ("bbb2222", SweepStatus.RUNNING), ("bbb2222", SweepStatus.FINISHED)):
        monkeypatch.setattr(runner, "process_commit", lambda c=commit: c)
        write_sweep_state(exp, status, "resume")
    state = read_json(tmp_path / "x" / STATE_DIR / SWEEP_FILE)
    assert state["commit"] == "aaa1111" and state["commits"] == ["aaa1111", "bbb2222"]
    assert state["status"] == SweepStatus.FINISHED


def test_a_taken_dashboard_port_gives_way_to_a_free_one(capsys):
    """Another Ray's dashboard on the configured port made `ray.init` fail the sweep."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        port = runner.dashboard_port("127.0.0.1", taken)
        assert port != taken and f"dashboard port {taken} on 127.0.0.1 is taken" in capsys.readouterr().out
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # the one it chose was free
    assert runner.dashboard_port("127.0.0.1", port) == port and capsys.readouterr().out == ""


def test_without_the_dashboard_ray_still_gets_a_free_port(capsys, monkeypatch):
    """Ray binds the dashboard port even with the dashboard off, and logged an ERROR when another
    Ray had it: the port it is given is free, and nothing is said about a dashboard that is off."""
    import ray

    given = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: given.update(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        runner.start_ray(DashboardSettings(enabled=False, host="127.0.0.1", port=taken))
        assert given["include_dashboard"] is False and given["dashboard_port"] != taken
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", given["dashboard_port"]))
    assert capsys.readouterr().out == ""


def test_tunes_warnings_about_trials_without_results_are_left_out_only_when_that_is_all_they_say():
    """A restore, or an interrupted fit, has Tune warn about every trial not yet started (a line
    each, 28 on a resume of a 28-trial sweep); a trial whose results cannot be read for another
    reason is still said."""
    import logging

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("ray.tune.analysis.experiment_analysis", logging.WARNING, __file__, 1,
                                 message, None, None)

    missing = ("- e4m3-adamw-all-s42: FileNotFoundError('Could not fetch metrics for e4m3-adamw-all-s42: "
               "both result.json and progress.csv were not found at /x')")
    corrupt = "- e5m2-adamw-all-s42: JSONDecodeError('Expecting value: line 1 column 1 (char 0)')"
    assert runner.is_ray_noise(record(f"Failed to fetch metrics for 2 trial(s):\n{missing}\n{missing}"))
    assert not runner.is_ray_noise(record(f"Failed to fetch metrics for 2 trial(s):\n{missing}\n{corrupt}"))
    assert runner.is_ray_noise(record("Experiment has been interrupted, but the most recent state was saved."))
    assert not runner.is_ray_noise(record("Trial e4m3 errored after 3 iterations"))
