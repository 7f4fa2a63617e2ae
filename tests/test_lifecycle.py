"""What a re-run of an existing experiment does (`altgrad.tune.lifecycle`): continue it, refuse a
changed config, never clobber a directory, `--fresh` moves it aside."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

from sweep_helpers import ABLATION, ablation

from altgrad.experiment import STATE_DIR, SWEEP_FILE, SweepStatus


def existing(tmp_path, status: str, **config_changes) -> Path:
    """An experiment dir as a finished/interrupted sweep leaves it (its sweep.json)."""
    from altgrad.tune.config import SweepConfig, load_sweep_config

    cfg = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu"], storage_path=str(tmp_path))
    doc = cfg.model_dump(mode="json")
    doc["base"] = {**doc["base"], **{k: {**doc["base"].get(k, {}), **v} for k, v in config_changes.items()}}
    exp = tmp_path / "format_ablation"
    (exp / STATE_DIR).mkdir(parents=True)
    (exp / STATE_DIR / SWEEP_FILE).write_text(json.dumps({"status": status, "config": doc, "points": [],
                                                          "driver": {"pid": 1, "host": "elsewhere"}}))
    return exp


def test_rerun_with_another_config_is_refused(tmp_path, capsys):
    existing(tmp_path, "interrupted", train={"max_steps": 30})
    assert ablation("--storage-path", str(tmp_path), "--set", "preset=cpu") == 2
    err = capsys.readouterr().err
    assert "already exists with a different config" in err and "base.train" in err
    assert "--resume" in err and "--fresh" in err
    assert ablation("--storage-path", str(tmp_path), "--set", "preset=cpu", "--resume",
                    "--set", "base.optim.lr=1e-3") == 2  # --resume with an explicit, different config
    assert "different config" in capsys.readouterr().err


def test_a_dry_run_shows_what_the_run_would_do_with_an_existing_experiment(tmp_path, capsys):
    """`--resume --dry-run` plans the stored config (it printed the config file's grid), and a dry
    run the real run would refuse is refused the same way."""
    existing(tmp_path, "interrupted", train={"max_steps": 30})
    assert ablation("--storage-path", str(tmp_path), "--resume", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "exists (interrupted): a run continues it with its stored config" in out
    assert "up to 30 steps" in out and "up to 160 steps" not in out
    assert ablation("--storage-path", str(tmp_path), "--set", "preset=cpu", "--dry-run") == 2
    assert "already exists with a different config" in capsys.readouterr().err
    assert ablation("--storage-path", str(tmp_path), "--fresh", "--dry-run") == 0
    assert "exists (interrupted): a run moves it aside and starts over" in capsys.readouterr().out
    # a finished one is complete; a running one is refused, as the run would be
    sweep = tmp_path / "format_ablation" / STATE_DIR / SWEEP_FILE
    doc = json.loads(sweep.read_text())
    sweep.write_text(json.dumps({**doc, "status": "finished"}))
    assert ablation("--storage-path", str(tmp_path), "--resume", "--dry-run") == 0
    assert "exists (finished): complete: a run prints its trial table and report" in capsys.readouterr().out
    sweep.write_text(json.dumps({**doc, "status": "running", "driver": {"pid": os.getpid(), "host": socket.gethostname()}}))
    assert ablation("--storage-path", str(tmp_path), "--resume", "--dry-run") == 2
    assert "is running right now" in capsys.readouterr().err


def test_resume_needs_an_experiment_and_dirs_are_never_clobbered(tmp_path, capsys):
    assert ablation("--storage-path", str(tmp_path), "--resume") == 2
    assert "nothing to resume" in capsys.readouterr().err
    (tmp_path / "format_ablation").mkdir()
    (tmp_path / "format_ablation" / "notes.txt").write_text("mine")
    assert ablation("--storage-path", str(tmp_path), "--set", "preset=cpu") == 2
    assert "is not an AltGrad experiment" in capsys.readouterr().err
    assert (tmp_path / "format_ablation" / "notes.txt").read_text() == "mine"


def test_fresh_moves_the_old_experiment_aside(tmp_path):
    from altgrad.tune.lifecycle import move_aside

    exp = existing(tmp_path, "finished")
    moved = move_aside(str(exp))
    assert not exp.exists() and moved.name.startswith("format_ablation.old-")
    assert (moved / STATE_DIR / SWEEP_FILE).is_file()
    assert move_aside(str(exp)) is None


def test_a_sweep_stored_before_the_stopper_thresholds_moved_still_resumes(tmp_path):
    """sweep.json of a sweep started when `stopper.nan_patience` etc. were stopper settings: read
    back, they are the run settings that replaced them, and the config validates."""
    from altgrad.tune.config import SweepConfig
    from altgrad.tune.lifecycle import stored_sweep

    exp = existing(tmp_path, "interrupted")
    path = exp / STATE_DIR / SWEEP_FILE
    doc = json.loads(path.read_text())
    doc["config"]["stopper"] = {"enabled": True, "nan_patience": 3, "stall_threshold": 0.95, "stall_reports": 7}
    path.write_text(json.dumps(doc))
    upgraded = SweepConfig.validated(stored_sweep(str(exp))["config"])
    stability = upgraded.base_run.stability
    assert (stability.nan_patience, stability.stall_stop, stability.stall_stop_reports) == (3, 0.95, 7)
    doc["config"]["stopper"]["nan_patience"] = None  # "the trainer's own", as it was stored then
    doc["config"]["base"]["stability"] = {"nan_patience": 11}
    path.write_text(json.dumps(doc))
    assert SweepConfig.validated(stored_sweep(str(exp))["config"]).base_run.stability.nan_patience == 11


def test_a_sweep_resumes_from_any_working_directory(tmp_path, monkeypatch):
    """The shipped config's data source is relative (`../shared/data/eurlex`). The stored config
    holds it resolved where the sweep was created, so `--resume` from another directory trains on
    the same data; a re-run from where it started still matches the stored config, and so does
    one of a sweep stored with the relative path (before paths were stored absolute)."""
    started, elsewhere, data = work_dirs(tmp_path)
    trained = train_nothing(monkeypatch)
    monkeypatch.chdir(started)
    exp = existing(tmp_path, "interrupted")
    monkeypatch.chdir(elsewhere)
    assert ablation("--storage-path", str(tmp_path), "--resume") == 128 + signal.SIGINT
    monkeypatch.chdir(started)
    assert ablation("--storage-path", str(tmp_path), "--set", "preset=cpu") == 128 + signal.SIGINT
    path = exp / STATE_DIR / SWEEP_FILE
    doc = json.loads(path.read_text())
    doc["config"]["base"]["data"] = {"source": "jsonl:../shared/data/eurlex"}  # as stored before
    path.write_text(json.dumps(doc))
    assert ablation("--storage-path", str(tmp_path), "--set", "preset=cpu") == 128 + signal.SIGINT
    assert trained == [{(f"jsonl:{data}", str(started / "data"))}] * 3


def test_relative_data_paths_an_older_version_stored_are_where_the_sweep_started(tmp_path, monkeypatch,
                                                                                  capsys):
    """An older sweep.json holds `base.data` as given, relative. Meant where the sweep was started
    (the parent of its default `experiments` folder, which was stored resolved there), not wherever
    `--resume` is typed; where nothing says where it started, a resume from elsewhere fails naming
    the data folder it looked for."""
    started, elsewhere, data = work_dirs(tmp_path)
    monkeypatch.chdir(started)
    for storage in (started / "experiments", tmp_path / "store"):
        path = existing(storage, "interrupted") / STATE_DIR / SWEEP_FILE
        doc = json.loads(path.read_text())
        doc["config"]["base"]["data"] = {"source": "jsonl:../shared/data/eurlex", "data_root": "data"}
        path.write_text(json.dumps(doc))
    monkeypatch.chdir(elsewhere)
    assert ablation("--storage-path", str(tmp_path / "store"), "--resume") == 2
    assert f"jsonl folder {tmp_path}/home/me/shared/data/eurlex does not exist" in capsys.readouterr().err
    trained = train_nothing(monkeypatch)
    assert ablation("--storage-path", str(started / "experiments"), "--resume") == 128 + signal.SIGINT
    assert trained == [{(f"jsonl:{data}", str(started / "data"))}]


def test_an_older_sweep_whose_data_section_is_not_a_mapping_is_one_error(tmp_path, monkeypatch, capsys):
    """`base.data` that is no mapping (a hand-edited sweep.json) is refused by validation, one line,
    not an AttributeError from looking for its data."""
    started, elsewhere, _ = work_dirs(tmp_path)
    monkeypatch.chdir(started)
    path = existing(started / "experiments", "interrupted") / STATE_DIR / SWEEP_FILE
    doc = json.loads(path.read_text())
    doc["config"]["base"]["data"] = "eurlex"
    path.write_text(json.dumps(doc))
    monkeypatch.chdir(elsewhere)
    assert ablation("--storage-path", str(started / "experiments"), "--resume") == 2
    err = capsys.readouterr().err
    assert "base.data" in err and "Traceback" not in err


def test_an_older_sweep_stored_in_a_folder_named_experiments_elsewhere_resumes_where_it_started(
        tmp_path, monkeypatch):
    """`--storage-path /scratch/experiments` with the sweep started in the checkout: the folder's
    name alone does not say where it started, and resumed from where it did, its relative data
    paths still name the data there (a guess from the name alone read them from /scratch: helper-24)."""
    started, _, data = work_dirs(tmp_path)
    monkeypatch.chdir(started)
    path = existing(tmp_path / "scratch" / "experiments", "interrupted") / STATE_DIR / SWEEP_FILE
    doc = json.loads(path.read_text())
    doc["config"]["base"]["data"] = {"source": "jsonl:../shared/data/eurlex", "data_root": "data"}
    path.write_text(json.dumps(doc))
    trained = train_nothing(monkeypatch)
    assert ablation("--storage-path", str(tmp_path / "scratch" / "experiments"), "--resume") == 128 + signal.SIGINT
    assert trained == [{(f"jsonl:{data}", str(started / "data"))}]


def work_dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Where a sweep is started, another working directory, and the data the shipped config names
    relative to the first (`../shared/data/eurlex`)."""
    started, elsewhere = tmp_path / "work" / "main", tmp_path / "home" / "me" / "other"
    data = tmp_path / "work" / "shared" / "data" / "eurlex"
    for folder in (started, elsewhere, data):
        folder.mkdir(parents=True)
    return started, elsewhere, data


def interrupted(exp, resume_command: str) -> tuple[SweepStatus, int]:
    """What `run_experiment` stores and returns for an experiment that Ctrl-C interrupted."""
    from altgrad.tune.runner import write_sweep_state

    write_sweep_state(exp, SweepStatus.INTERRUPTED, resume_command)
    return SweepStatus.INTERRUPTED, signal.SIGINT


def train_nothing(monkeypatch) -> list[set[tuple[str, str]]]:
    """The sweep entry point without data preparation, Ray or trials: each experiment it runs adds
    the data (source, data_root) its trials would train on, and is interrupted."""
    import altgrad.data
    from altgrad.tune import cli

    trained: list[set[tuple[str, str]]] = []

    def run_experiment(exp, restore: bool, resume_command: str):
        trained.append({(p.run["data"]["source"], p.run["data"]["data_root"]) for p in exp.points.values()})
        return interrupted(exp, resume_command)

    monkeypatch.setattr(altgrad.data, "prepare_dataset", lambda data: None)
    monkeypatch.setattr(cli, "start_ray", lambda dashboard: None)
    monkeypatch.setattr(cli, "run_experiment", run_experiment)
    return trained


def test_fresh_checks_everything_before_it_moves_the_old_experiment(tmp_path, capsys):
    """A data source that does not exist fails the run: the old experiment stays where it was."""
    exp = existing(tmp_path, "finished")
    assert ablation("--storage-path", str(tmp_path), "--set", "preset=cpu", "--fresh",
                    "--set", "base.data.source=jsonl:/nonexistent") == 2
    out, err = capsys.readouterr()
    assert "jsonl folder /nonexistent does not exist" in err and "moved" not in out
    assert (exp / STATE_DIR / SWEEP_FILE).is_file() and sorted(p.name for p in tmp_path.iterdir()) == [exp.name]


def test_a_corrupt_sweep_file_is_a_clean_error(tmp_path, capsys):
    exp = existing(tmp_path, "interrupted")
    (exp / STATE_DIR / SWEEP_FILE).write_text("{not json")
    for mode in ([], ["--resume"], ["--fresh"]):  # whether it runs is unknown: --fresh may not move it either
        assert ablation("--storage-path", str(tmp_path), "--set", "preset=cpu", *mode) == 2
        err = capsys.readouterr().err
        assert f"{exp}: its {STATE_DIR}/{SWEEP_FILE} is corrupt (" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [exp.name]


def test_storage_that_cannot_be_reached_is_a_clean_error(monkeypatch, capsys):
    """As `python -m altgrad trials` says it (exit 2, the path and why), not pyarrow's traceback."""
    for key, value in {"AWS_ENDPOINT_URL": "http://127.0.0.1:1", "AWS_ACCESS_KEY_ID": "x",
                       "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    assert ablation("--storage-path", "s3://altgrad-sweeps/unreachable", "--set", "preset=cpu") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read s3://altgrad-sweeps/unreachable/format_ablation: ")
    assert "Traceback" not in err


def test_a_finished_sweep_on_s3_says_what_starts_it_again(s3_bucket, capsys):
    """--fresh cannot move an experiment in a bucket: the sweep names what works instead."""
    from altgrad.tune.config import SweepConfig, load_sweep_config
    from altgrad.tune.store import StateStore

    storage = f"{s3_bucket}/finished"
    cfg = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu"], storage_path=storage)
    StateStore(cfg.experiment_path).write(SWEEP_FILE, {"status": "finished", "points": [],
                                                       "config": cfg.model_dump(mode="json")})
    assert ablation("--storage-path", storage, "--set", "preset=cpu") == 0
    out = capsys.readouterr().out
    assert f"sweep format_ablation is complete ({cfg.experiment_path}); run it again under another --name" in out
    assert "--fresh starts it over" not in out
    assert ablation("--storage-path", storage, "--set", "preset=cpu", "--set", "base.optim.lr=1e-3") == 2
    err = capsys.readouterr().err
    assert "already exists with a different config" in err and "--fresh" not in err
    assert ablation("--storage-path", storage, "--set", "preset=cpu", "--fresh") == 2
    assert "--fresh cannot move" in capsys.readouterr().err


def test_a_bare_resume_keeps_how_the_sweep_is_watched(tmp_path, monkeypatch):
    """`--resume` alone loads the default config file for the rest of its defaults: the stored
    sweep's dashboard and smoke settings stay its own (the default file's turned a sweep's dashboard
    back on, and were stored as its config); one said anew on resume (--set) is taken."""
    import altgrad.data
    from altgrad.tune import cli

    exp = existing(tmp_path, "interrupted")
    path = exp / STATE_DIR / SWEEP_FILE
    doc = json.loads(path.read_text())
    assert doc["config"]["dashboard"]["enabled"] and doc["config"]["smoke"]  # the default file's
    doc["config"]["dashboard"]["enabled"], doc["config"]["smoke"] = False, {}
    path.write_text(json.dumps(doc))
    dashboards = []
    monkeypatch.setattr(altgrad.data, "prepare_dataset", lambda data: None)
    monkeypatch.setattr(cli, "start_ray", lambda dashboard: dashboards.append(dashboard.enabled))
    monkeypatch.setattr(cli, "run_experiment", lambda exp, restore, resume_command: (
        dashboards.append(exp.settings.dashboard.enabled) or interrupted(exp, resume_command)))
    assert ablation("--storage-path", str(tmp_path), "--resume") == 128 + signal.SIGINT
    assert dashboards == [False, False]
    stored = json.loads(path.read_text())["config"]
    assert (stored["dashboard"]["enabled"], stored["smoke"]) == (False, {})  # stored as it was
    dashboards.clear()
    assert ablation("--storage-path", str(tmp_path), "--set", "preset=cpu", "--resume",
                    "--set", "dashboard.enabled=true") == 128 + signal.SIGINT
    assert dashboards == [True, True]


def test_a_sweep_interrupted_while_ray_starts_can_be_resumed(tmp_path, monkeypatch, capsys):
    """Ray's start-up takes seconds after "starting sweep": the sweep is stored before it, so a kill
    or Ctrl-C there leaves one to resume (it said "nothing to resume"), and Ctrl-C prints how."""
    import altgrad.data
    from altgrad.tune import cli

    def ctrl_c(dashboard):
        raise KeyboardInterrupt

    monkeypatch.setattr(altgrad.data, "prepare_dataset", lambda data: None)
    monkeypatch.setattr(cli, "start_ray", ctrl_c)
    assert ablation("--storage-path", str(tmp_path), "--set", "preset=cpu") == 128 + signal.SIGINT
    out = capsys.readouterr().out
    assert "interrupted" in out and "resume with: " in out and "--resume" in out.split("resume with: ")[1]
    stored = json.loads((tmp_path / "format_ablation" / STATE_DIR / SWEEP_FILE).read_text())
    assert stored["status"] == SweepStatus.INTERRUPTED
    trained = train_nothing(monkeypatch)
    assert ablation("--storage-path", str(tmp_path), "--resume") == 128 + signal.SIGINT
    assert len(trained) == 1
