"""`python -m altgrad train`: a run dir with its files, and clean exits on user errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from altgrad.__main__ import main
from altgrad.config import ConfigError
from altgrad.train.cli import new_run_dir

REPO = Path(__file__).resolve().parents[1]


def data_args(eurlex_dir: Path, data_root: Path) -> list[str]:
    """A small cpu-preset run on the EUR-Lex fixtures."""
    settings = [f"data.source=jsonl:{eurlex_dir}", f"data.data_root={data_root}", "data.max_docs=40",
                "preset=cpu", "model.block_size=32", "train.batch_size=4", "train.warmup_steps=1"]
    return [arg for s in settings for arg in ("--set", s)]


@pytest.mark.usefixtures("eager_kernels")  # the CLI, not the kernels (test_trainer trains compiled)
def test_train_writes_a_run_dir_and_resumes(eurlex_dir, data_root, tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        *data_args(eurlex_dir, data_root),
        "--set",
        "train.max_steps=6",
        "--set",
        "train.eval_interval=3",
        "--set",
        "train.checkpoint_interval=3",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "step 3/6" in printed and "done: completed after 6 steps" in printed
    for name in ("config.yaml", "metrics.jsonl", "events.jsonl", "summary.json", "checkpoints"):
        assert (out / name).exists(), name
    assert main(["train", "--resume", str(out), "--set", "train.max_steps=9", "--quiet"]) == 0
    said = capsys.readouterr()
    assert "completed after 9 steps" in said.out
    # a resume that changes the run's settings says so, and its events record it
    assert "note: resumed from step 6 with changed settings: train.max_steps: 6 -> 9" in said.err
    resumed = [e for e in map(json.loads, (out / "events.jsonl").read_text().splitlines()) if e["kind"] == "resume"]
    assert resumed[-1]["changed"] == ["train.max_steps: 6 -> 9"]

    # resuming a complete run trains nothing and touches nothing (it rewrote its summary, losing
    # the first step's time, and logged a resume)
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(out), "--quiet"]) == 0
    assert "is complete (9 steps): nothing to train" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files

    # resuming to fewer steps than the checkpoint has taken is refused, and nothing is rewritten
    assert main(["train", "--resume", str(out), "--set", "train.max_steps=6", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint is at step 9, past train.max_steps=6" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files

    # --resume continues in the run's own directory: an --out beside it is refused, not ignored
    assert main(["train", "--resume", str(out), "--out", str(tmp_path / "other"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "error: --resume continues the run in its own directory; drop --out" in err and "Traceback" not in err
    assert not (tmp_path / "other").exists()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files

    # a resume's --set is checked like a new run's config (a rule matching no layer: exit 2, no traceback)
    assert main(["train", "--resume", str(out), "--set", "quant.precision=[{pattern: nomatch, format: e4m3}]"]) == 2
    assert "match no linear layer" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files

    # a checkpoint inside the run is not a run directory: the error names the run to give instead
    (older, *_) = sorted((out / "checkpoints").glob("step_*"))
    for inside in (older, older.parent):
        assert main(["train", "--resume", str(inside), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"give the run directory, --resume {out.resolve()};" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files

    # its formats do not change on resume: the checkpoint's would replace the new ones, which the
    # run's records would then claim
    for changed in ("quant.format=e5m2", "quant.precision=mlp"):
        assert main(["train", "--resume", str(out), "--set", changed, "--set", "train.max_steps=12", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "a run's formats do not change on resume" in err and "Traceback" not in err
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files

    # a corrupt line before the last of a log (not a kill's torn last line): exit 2, named, and
    # nothing rewritten, whichever log it is in (every one is read before any is truncated)
    logs = ["metrics.jsonl", "events.jsonl", "bit_positions.jsonl"]
    assert all(len((out / log).read_text().splitlines()) >= 2 for log in logs)
    for log in logs:
        lines = (out / log).read_text().splitlines(keepends=True)
        (out / log).write_text("".join([lines[0][:20] + "\n", *lines[1:]]))
        files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        assert main(["train", "--resume", str(out), "--set", "train.max_steps=12", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"{log}: line 1 is not valid JSON" in err and "mend or remove that line" in err
        assert "Traceback" not in err and {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
        (out / log).write_text("".join(lines))
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    # a new run cannot take over the directory: it would delete this run's metrics and mix checkpoints
    assert main(["train", *data_args(eurlex_dir, data_root), "--set", "train.max_steps=2",
                 "--set", "quant.format=e5m2", "--out", str(out), "--quiet"]) == 2
    assert f"--out {out} is not empty: continue the run there with --resume" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["quant.format=e4m4"], "quant.format"),
        (["optim.lr=-0.1"], "optim.lr"),
        (["model.block_size=10000000"], "block_size"),
        (["data.source=jsonl:/nonexistent/eurlex"], "/nonexistent/eurlex"),
        (["quant.precision=[{pattern: '*.mlp.*', format: e4m3}, {pattern: nomatch, format: e5m2}]"],
         "quant.precision: layer pattern(s) ['nomatch'] match no linear layer"),
    ],
)
def test_config_errors_exit_2_and_write_nothing(
    overrides, message, eurlex_dir, data_root, tmp_path, capsys
):
    out = tmp_path / "run"
    args = ["train", *data_args(eurlex_dir, data_root), "--out", str(out)]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err
    assert not out.exists()


def test_out_that_is_a_file_is_a_clean_error(eurlex_dir, data_root, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("train: {max_steps: 2}\n")
    assert main(["train", *data_args(eurlex_dir, data_root), "--out", str(config), "--quiet"]) == 2
    assert "a file, not a directory" in capsys.readouterr().err
    assert config.read_text() == "train: {max_steps: 2}\n"


@pytest.mark.parametrize("out", ["file.yaml/run", "/proc/altgrad-run"])
def test_out_that_cannot_be_a_directory_is_a_clean_error(out, eurlex_dir, data_root, tmp_path, capsys):
    """A file above --out, or a place that holds no directories: exit 2 before anything is prepared."""
    (tmp_path / "file.yaml").write_text("mine")
    out = tmp_path / out
    assert main(["train", *data_args(eurlex_dir, data_root), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out}: cannot make this directory (") and "Traceback" not in err
    assert (tmp_path / "file.yaml").read_text() == "mine"


def test_cuda_without_a_device_is_a_clean_error(eurlex_dir, data_root, tmp_path, monkeypatch, capsys):
    """train.device=cuda where there is none (simulated on a GPU machine): exit 2 with the reason,
    not a traceback from pinning the first batch; the default run directory it claimed is gone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["train", *data_args(eurlex_dir, data_root), "--set", "train.device=cuda", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "train.device=cuda, but this machine has no CUDA device" in err and "Traceback" not in err
    assert not list((tmp_path / "runs").iterdir())


def test_default_run_dirs_started_in_one_second_differ(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261202-120000")
    first, second = new_run_dir(None, "e4m3-adamw"), new_run_dir(None, "e4m3-adamw")
    assert first != second and first.is_dir() and second.is_dir()
    assert [first.name, second.name] == ["20261202-120000-e4m3-adamw", "20261202-120000-e4m3-adamw-2"]
    monkeypatch.chdir(first)
    Path("runs").write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot make a run directory runs/20261202-120000-e4m3-adamw"):
        new_run_dir(None, "e4m3-adamw")


def test_corrupt_resume_target_is_a_clean_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "altgrad", "train", "--resume", str(run)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert (
        proc.returncode == 2
        and "not a run directory" in proc.stderr
        and "Traceback" not in proc.stderr
    )


def test_ctrl_c_keeps_the_run_and_says_how_to_continue(eurlex_dir, data_root, tmp_path, request):
    """Ctrl-C mid-run exits 130 with the resume command, no traceback; summary.json says how far
    the run got, and the resume it names finishes the run."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "ALTGRAD_NO_COMPILE": "1"}
    # As from a terminal: Python turns SIGINT into KeyboardInterrupt only where it starts with SIGINT's
    # default action, and a suite run in the background of a non-interactive shell (`make test &`)
    # starts with SIGINT ignored, as its processes then do: the run trained on, and the test waited.
    ctrl_c = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "sys.argv[0] = 'altgrad'; runpy.run_module('altgrad', run_name='__main__')")
    args = [sys.executable, "-c", ctrl_c, "train", *data_args(eurlex_dir, data_root), "--set",
            "train.max_steps=100000", "--set", "train.checkpoint_interval=2", "--out", str(out), "--quiet"]
    proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    request.addfinalizer(proc.kill)  # failed, it would train on through the rest of the suite
    deadline = time.monotonic() + 180
    while not (out / "checkpoints" / "step_00000002").is_dir():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no checkpoint at step 2: {proc.communicate()}")
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert f"python -m altgrad train --resume {out}" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps"] >= 2 and summary["stop_reason"] is None
    finish = summary["steps"] + 2
    resumed = subprocess.run([sys.executable, "-m", "altgrad", "train", "--resume", str(out), "--set",
                              f"train.max_steps={finish}", "--quiet"], env=env, cwd=tmp_path, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("finished", finish)
