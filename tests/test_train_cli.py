"""`python -m altgrad train`: a run dir with its files, and clean exits on user errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from altgrad.__main__ import main

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
    assert "completed after 9 steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["quant.format=e4m4"], "quant.format"),
        (["optim.lr=-0.1"], "optim.lr"),
        (["model.block_size=10000000"], "block_size"),
        (["data.source=jsonl:/nonexistent/eurlex"], "/nonexistent/eurlex"),
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
