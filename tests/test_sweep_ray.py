"""Sweeps on the session's one Ray instance (cpu preset, three-trial grids, 30 steps).

- an uninterrupted sweep (the reference): full trial table, the NaN-prone e7m0 stopped for `nan`;
- kill -9 of the driver mid-trial, then `--resume`: the same table as the reference;
- with two trials at a time, kill -9 then `--resume`: ASHA keeps every rung record made before;
- SIGTERM: exit 143, the resume command, and the resume finishing the sweep;
- a trial whose worker process dies is retried from its checkpoint;
- a sweep on a bucket (a real S3 server), its machine lost mid-sweep, resumed from another.
Drivers that get killed run in subprocesses that join the shared instance through RAY_ADDRESS
(the bucket's drivers each start their own Ray, as on their own machines).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
from sweep_helpers import (
    ABLATION,
    CHECKPOINT,
    LR_SEARCH,
    STEPS,
    kill_processes_mentioning,
    last_step,
    start_driver,
    tiny_lr_search,
    wait_for,
)
from wandb_reading import history_steps, offline_runs

from altgrad.__main__ import main
from altgrad.config import load_config
from altgrad.experiment import (
    ASHA_FILE,
    CONFIG_FILE,
    RUN_DIR,
    STATE_DIR,
    SWEEP_FILE,
    TRIALS_DIR,
    TRIALS_FILE,
    load_experiment,
)
from altgrad.provenance import source_commit
from altgrad.remote import join
from altgrad.report.cli import report_after_sweep
from altgrad.trial_table import trial_row
from altgrad.tune.ablation import FormatAblation
from altgrad.tune.cli import sweep_main
from altgrad.tune.config import SWEEP_PRESETS
from altgrad.tune.wandb_runs import run_id

pytestmark = [pytest.mark.ray, pytest.mark.slow]

COMPARED = ("trial", "status", "stop_reason", "steps", "best_val_loss", "bit_stall", "overflow", "shadow_cos")


def table(exp_dir: Path) -> list[dict]:
    return [{k: trial_row(r)[k] for k in COMPARED} for r in load_experiment(exp_dir)]


@pytest.fixture(scope="module")
def reference(ray_address, sweep_args, tmp_path_factory):
    """An uninterrupted sweep, run in this process on the shared Ray instance."""
    storage = tmp_path_factory.mktemp("reference")
    code = sweep_main(FormatAblation, ABLATION, "test", [*sweep_args, "--name", "ref", "--storage-path", str(storage)],
                      after=report_after_sweep)  # as sweeps/format_ablation.py does
    return code, storage / "ref"


def test_sweep_end_to_end(reference, capsys):
    code, exp = reference
    assert code == 0
    rows = {r["trial"]: r for r in table(exp)}
    assert list(rows) == ["bf16-adamw-all-s42", "e4m3-adamw-all-s42", "e7m0-adamw-all-s42"]
    assert all(r["status"] == "TERMINATED" for r in rows.values())
    assert rows["bf16-adamw-all-s42"]["stop_reason"] == "completed"
    assert rows["bf16-adamw-all-s42"]["steps"] == STEPS
    nan = rows["e7m0-adamw-all-s42"]
    assert nan["stop_reason"] == "nan" and nan["steps"] < STEPS  # at its patience: trainer and stopper agree
    assert json.loads((exp / STATE_DIR / "stopper.json").read_text())["stopped"]
    e7m0 = next(r for r in load_experiment(exp) if r.format == "e7m0")
    assert e7m0.stop_detail.startswith("nan: 3 non-finite steps in a row (patience 3)")
    assert rows["e4m3-adamw-all-s42"]["stop_reason"] in ("completed", "asha")
    assert (exp / "report" / "report.md").is_file()
    cpus = SWEEP_PRESETS["cpu"]["cpus_per_trial"]
    for trial in load_experiment(exp):
        assert (trial.trial_dir / "trial.log").is_file() and (trial.trial_dir / "worker.json").is_file()
        # each trial computed with its CPUs' threads and says so: its config.yaml re-runs it exactly
        assert load_config(trial.trial_dir / RUN_DIR / CONFIG_FILE).train.threads == cpus
        # and names the code it ran: this checkout's, which the sweep started with
        assert json.loads((trial.trial_dir / "worker.json").read_text())["commit"] == source_commit()
    assert json.loads((exp / STATE_DIR / SWEEP_FILE).read_text())["commits"] == [source_commit()]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def resume(args: list[str], ray_address: str) -> str:
    proc = start_driver([*args, "--resume"], ray_address)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    return out


# What Ray prints by default around the sweep's own lines (a configuration box, a TensorBoard
# hint, INFO lines, a token warning the dashboard line already explains): none of it reaches the
# console.
RAY_CHATTER = ("Configuration for experiment", "To visualize your results with TensorBoard",
               "Wrote the latest version of all result files", "Started a local Ray instance",
               "Token authentication is enabled", "Failed to fetch metrics")


def test_kill9_then_resume_equals_uninterrupted(reference, ray_address, sweep_args, tmp_path, capsys):
    """SIGKILL twice: while the first trial trains past its first checkpoint, and once the last
    trial has started (after ASHA and the stopper decided about the others). Each time `--resume`
    continues; the final table equals the reference, and the first kill cost at most one
    checkpoint interval of redone steps."""
    args = [*sweep_args, "--name", "killed", "--storage-path", str(tmp_path)]
    exp = tmp_path / "killed"
    first, *_, last = [t["key"] for t in json.loads(_read(reference[1] / STATE_DIR / "sweep.json"))["points"]]

    proc = start_driver(args, ray_address)
    wait_for(lambda: last_step(exp, first) >= CHECKPOINT + 3, proc)
    assert main(["trials", str(exp), "--json"]) == 0  # readable while the sweep runs
    live = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in live] == ["RUNNING", "PENDING", "PENDING"] and live[0]["steps"] > CHECKPOINT
    assert sweep_main(FormatAblation, ABLATION, "test", [*args, "--resume"]) == 2  # a second driver
    assert f"sweep {exp} is running right now (driver pid {proc.pid}" in capsys.readouterr().err
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = last_step(exp, first)

    proc = start_driver([*args, "--resume"], ray_address)
    wait_for(lambda: last_step(exp, last) >= 2, proc)
    proc.send_signal(signal.SIGKILL)
    restored, _ = proc.communicate()  # (it restored two trials that had not started)

    out = resume(args, ray_address)
    for said in (restored, out):
        assert not [line for line in said.splitlines() if any(chatter in line for chatter in RAY_CHATTER)], said
    assert table(exp) == table(reference[1])
    (record, *_) = load_experiment(exp)
    resumed_from = next(e["step"] for e in record.events if e["kind"] == "resume")
    assert killed_at - resumed_from <= CHECKPOINT


def test_kill9_with_concurrency_keeps_asha_rungs(ray_address, sweep_args, tmp_path):
    args = [*sweep_args, "--set", "max_concurrent_trials=2", "--name", "pairs", "--storage-path", str(tmp_path)]
    exp = tmp_path / "pairs"
    asha = exp / STATE_DIR / ASHA_FILE
    proc = start_driver(args, ray_address)
    wait_for(lambda: _read(asha) is not None and any(json.loads(asha.read_text())["rungs"].values()), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = json.loads(asha.read_text())
    resume(args, ray_address)
    after = json.loads(asha.read_text())
    for rung, records in before["rungs"].items():
        assert records.items() <= after["rungs"][rung].items()
    assert before["stopped"].items() <= after["stopped"].items()
    assert all(r.status == "TERMINATED" for r in load_experiment(exp))


def test_sigterm_exits_143_with_the_resume_command_and_resume_finishes(ray_address, sweep_args, tmp_path):
    """SIGTERM, what a spot instance's shutdown sends, takes Ray's SIGINT path (Ctrl-C's:
    `test_runner.test_sigterm_takes_the_sigint_path`), so one driver tests both."""
    signum = signal.SIGTERM
    args = [*sweep_args, "--name", "stopped", "--storage-path", str(tmp_path)]
    proc = start_driver(args, ray_address)
    wait_for(lambda: last_step(tmp_path / "stopped", "bf16-adamw-all-s42") >= 3, proc)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, out[-3000:]
    command = f"--name stopped --storage-path {tmp_path} --resume"
    assert "resume with: " in out and command in out
    assert "Tuner.restore" not in out  # Ray's own hint would restore without the sweep's settings
    assert "Failed to fetch metrics" not in out  # Tune's line per trial not started yet
    sweep = json.loads((tmp_path / "stopped" / STATE_DIR / "sweep.json").read_text())
    assert sweep["status"] == "interrupted" and command in sweep["resume_command"]
    resume(args, ray_address)
    assert [r["status"] for r in table(tmp_path / "stopped")] == ["TERMINATED"] * 3


def test_fresh_moves_a_finished_sweep_aside_and_runs_again(reference, sweep_args, tmp_path, capsys):
    """`--fresh` through the CLI, on a copy of a real finished sweep: the old experiment is moved
    aside intact, the new one runs from scratch."""
    exp = tmp_path / "ref"
    shutil.copytree(reference[1], exp)
    old_table = table(exp)
    args = ["--set", "grid.formats=[bf16]", "--set", "base.train.max_steps=12", "--name", "ref",
            "--storage-path", str(tmp_path), "--fresh"]
    assert sweep_main(FormatAblation, ABLATION, "test", [*sweep_args, *args]) == 0
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("ref.old-")]
    assert f"moved the previous experiment aside to {moved}" in capsys.readouterr().out
    assert table(moved) == old_table
    assert [(r["trial"], r["steps"]) for r in table(exp)] == [("bf16-adamw-all-s42", 12)]


def test_dead_worker_is_retried_from_its_checkpoint(ray_address, sweep_args, tmp_path):
    args = [*sweep_args, "--set", "grid.formats=[e4m3]", "--name", "crash", "--storage-path", str(tmp_path)]
    exp = tmp_path / "crash"
    killed: list[int] = []

    def kill_worker_after_first_checkpoint() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and last_step(exp, "e4m3-adamw-all-s42") < CHECKPOINT + 2:
            time.sleep(0.1)
        (entry,) = json.loads((exp / STATE_DIR / TRIALS_FILE).read_text()).values()
        pid = json.loads((exp / TRIALS_DIR / entry["key"] / "worker.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_worker_after_first_checkpoint, daemon=True)
    killer.start()
    assert sweep_main(FormatAblation, ABLATION, "test", args) == 0
    killer.join()
    assert killed
    (record,) = load_experiment(exp)
    assert (record.status, record.stop_reason, record.summary["steps"]) == ("TERMINATED", "completed", STEPS)
    (entry,) = json.loads((exp / STATE_DIR / TRIALS_FILE).read_text()).values()
    assert entry["failures"] == 1
    assert [e["step"] for e in record.events if e["kind"] == "resume"] == [CHECKPOINT]


def test_lr_search_end_to_end(ray_address, eurlex_dir, data_root, tmp_path, capsys):
    """sweeps/lr_search.py's path through Tune and Optuna on a tiny grid: the grid's learning rates
    run first, then a sample between the one that learned and the one that did not; the table and
    lr_search.json name the largest rate that trained stably (1000 diverges, 0.01 learns). W&B is
    on, as lr_search.yaml has it."""
    from altgrad.experiment import LR_SEARCH_FILE
    from altgrad.tune.lr_search import LrSearch

    args = [*tiny_lr_search(eurlex_dir, data_root, "wandb={enabled: true, mode: offline}"),
            "--name", "lr", "--storage-path", str(tmp_path)]
    assert sweep_main(LrSearch, LR_SEARCH, "test", args) == 0
    out = capsys.readouterr().out
    (row,) = json.loads((tmp_path / "lr" / LR_SEARCH_FILE).read_text())
    sweep_id = f"{tmp_path / 'lr' / 'e4m3'}@{json.loads((tmp_path / 'lr' / 'e4m3' / STATE_DIR / 'sweep.json').read_text())['started']}"
    records = load_experiment(tmp_path / "lr" / "e4m3")
    sampled = sorted(r.params["lr"] for r in records)
    assert len(sampled) == 3 and {0.01, 1000.0} <= set(sampled)
    (sample,) = set(sampled) - {0.01, 1000.0}
    assert 0.01 < sample < 1000.0
    stable = [r.params["lr"] for r in records if r.stop_reason == "completed"
              and r.val_series()[1][-1] < r.val_series()[1][0]]
    assert row["format"] == "e4m3" and row["trials"] == 3
    assert 0.01 in stable and 1000.0 not in stable and row["largest_stable_lr"] == max(stable)
    assert row["smallest_unstable_lr"] == min(set(sampled) - set(stable))
    assert "largest stable lr" in out and f"results: {tmp_path / 'lr' / LR_SEARCH_FILE}" in out
    for record in records:  # W&B: one offline run per trial, in the trial's directory
        runs = offline_runs(record.trial_dir)
        assert list(runs) == [run_id(sweep_id, record.key)]
        logged, reported = history_steps(*runs.values()), [int(r["step"]) for r in record.history]
        if record.stop_reason == "completed":
            assert logged == reported
        else:  # Ray kills a stopped trial's process: W&B may not have written its last rows
            assert logged == reported[:len(logged)]


def test_an_lr_search_with_no_rate_left_to_try_ends_finished(ray_address, eurlex_dir, data_root, tmp_path, capsys):
    """The grid's one rate (0.01) is the range's top and learns: the searcher asks for none of its
    2 samples, and the sweep ends finished (exit 0, not 'interrupted' with the resume command) with
    one trial, the table saying which bound to move."""
    from altgrad.tune.lr_search import LrSearch

    args = [*tiny_lr_search(eurlex_dir, data_root, "lr={grid: [0.01], low: 0.001, high: 0.01, samples: 2}"),
            "--name", "top", "--storage-path", str(tmp_path)]
    assert sweep_main(LrSearch, LR_SEARCH, "test", args) == 0
    out = capsys.readouterr().out
    exp = tmp_path / "top" / "e4m3"
    assert [r.params["lr"] for r in load_experiment(exp)] == [0.01]
    assert json.loads((exp / STATE_DIR / "sweep.json").read_text())["status"] == "finished"
    assert "e4m3: the range's top, lr.high (0.01), trained stably; the edge lies above the range" in out
    assert ("stable: ran its 10 steps, no val loss over 1 % above its first, the last finite and below the first; "
            "each rate ran once (seed 42)") in out
    assert "--resume" not in out


def test_lr_search_resume_tells_optuna_an_errored_grid_points_rerun(ray_address, eurlex_dir, data_root, tmp_path):
    """The grid point 0.01 errors (its worker killed, no retries): the search ends with exit 1, its
    sample drawn with 0.01 unknown. `--resume` runs it again, and its
    result reaches Optuna as a first run's would, through Tune's `ConcurrencyLimiter`
    (`max_concurrent_trials`): stable at 0.01; the table has it as the largest stable rate."""
    from altgrad.experiment import LR_SEARCH_FILE
    from altgrad.tune.lr_search import LrSearch
    from altgrad.tune.lr_searcher import GridThenEdge

    args = [*tiny_lr_search(eurlex_dir, data_root, "failure.max_failures=0", "max_concurrent_trials=1"),
            "--name", "rerun", "--storage-path", str(tmp_path)]
    exp = tmp_path / "rerun" / "e4m3"
    killed: list[int] = []

    def kill_the_first_grid_point() -> None:
        worker = exp / TRIALS_DIR / "e4m3-adamw-all-s42-lr0.01" / "worker.json"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not worker.exists():
            time.sleep(0.05)
        killed.append(json.loads(worker.read_text())["pid"])
        os.kill(killed[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_the_first_grid_point, daemon=True)
    killer.start()
    assert sweep_main(LrSearch, LR_SEARCH, "test", args) == 1
    killer.join()
    assert killed
    assert sweep_main(LrSearch, LR_SEARCH, "test", [*args, "--resume"]) == 0
    search = GridThenEdge([0.01, 1000.0])
    search.restore_from_dir(str(exp))  # the searcher's state as Tune saved it at the end
    told = {t.params["lr"]: t.value for t in search.told()}
    assert (told[0.01], told[1000.0], len(told)) == (0.01, 0.0, 3)
    (row,) = json.loads((tmp_path / "rerun" / LR_SEARCH_FILE).read_text())
    assert (row["trials"], row["unfinished"]) == (3, 0)
    assert row["largest_stable_lr"] == max(lr for lr, stable_lr in told.items() if stable_lr > 0)


def test_bucket_sweep_survives_losing_its_machine(reference, sweep_args, s3_bucket, tmp_path, capsys, request,
                                                 monkeypatch):
    """A sweep stored on S3 (a real S3-compatible server) loses its machine mid-trial: the driver's
    whole process group and its own Ray get SIGKILL, and its working directory, home and Ray temp
    dir are deleted. The printed resume command, run on another "machine" (fresh folders, a new
    Ray), finishes the sweep from the bucket alone: the trial table equals the uninterrupted one,
    and `trials` and `report` read the bucket directly. The server is named as Ray documents it,
    in the storage path's query (`?endpoint_override=`), with no AWS_ENDPOINT_URL anywhere: the
    sweep's own files went to `s3://…?endpoint_override=…/spot/sweep_state/…`, a key in no bucket."""
    from pyarrow.fs import FileSelector, FileSystem

    uri = f"{s3_bucket}/sweeps?endpoint_override={os.environ['AWS_ENDPOINT_URL']}"
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the drivers started below inherit its absence
    experiment = join(uri, "spot")
    args = [*sweep_args, "--name", "spot", "--storage-path", uri]
    fs, root = FileSystem.from_uri(experiment)

    def checkpointed() -> bool:  # a trial has uploaded a checkpoint to the bucket
        try:
            return any("/checkpoint_" in f.path for f in fs.get_file_info(FileSelector(root, recursive=True)))
        except OSError:
            return False

    machines = Path(tempfile.mkdtemp(prefix="altgrad-"))  # short: Ray's socket paths must fit 107 bytes
    request.addfinalizer(lambda: shutil.rmtree(machines, ignore_errors=True))
    lost = machines / "m1"
    proc = start_driver(args, None, machine=lost)
    wait_for(checkpointed, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kill_processes_mentioning(lost)  # its Ray, wherever it sits: the machine is gone
    shutil.rmtree(lost)

    capsys.readouterr()
    assert main(["trials", experiment]) == 0  # from the bucket: who is gone, and how to resume
    banner = capsys.readouterr().out
    assert f"experiment {experiment}: interrupted (its driver is gone)" in banner
    command = shlex.split(banner.split("resume with: ")[1].splitlines()[0])
    assert command[command.index("--storage-path") + 1] == uri and "--resume" in command
    proc = start_driver(command[command.index("--name"):], None, machine=machines / "m2")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    # the printed command runs in a shell as printed: the query's "&" and "?" quoted
    assert "resuming sweep spot" in out and f"python -m altgrad trials {shlex.quote(experiment)}" in out

    assert main(["trials", experiment, "--json"]) == 0
    rows = [{k: r[k] for k in COMPARED} for r in json.loads(capsys.readouterr().out)]
    assert rows == table(reference[1])
    assert main(["report", experiment, "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.md").is_file()
    assert fs.get_file_info(f"{root}/report/report.md").size > 0  # the sweep's own report, in the bucket
