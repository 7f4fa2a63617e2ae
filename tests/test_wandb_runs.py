"""W&B runs from the trial's own process (`altgrad.tune.wandb_runs`), read back from the offline
run files: one run per trial, the same run id across a crash and resume with every step logged
once, and stability events as alerts with a cooldown; an online sweep without a key is refused."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sweep_helpers import ablation
from wandb_reading import alerts, history_rows, history_steps, offline_runs

from altgrad.experiment import read_jsonl
from altgrad.metrics import model_wide
from altgrad.train import Trainer
from altgrad.train.checkpoint import resume_candidates
from altgrad.tune.wandb_runs import WandbSpec, run_id, trial_run

SPEC = WandbSpec(project="altgrad-test", mode="offline", group="test", sweep_id="/tmp/x/test@1")
MAX_STEPS, CRASH_AT, CHECKPOINT = 12, 10, 4


class Crash(Exception):
    pass


def attempt(cfg, trial_dir, crash_at: int | None, kill: bool = False) -> None:
    """What `train_trial` does with W&B: rows of the run directory a lost attempt may not have
    logged go to W&B first (`TuneReporter` replays them), then the training's own; a crash (an
    exception, or with `kill` a SIGKILL of this process) in the middle when asked."""
    run_dir = trial_dir / "run"
    history = read_jsonl(run_dir / "metrics.jsonl")
    with trial_run(SPEC, "e7m0-adamw-all-s42", cfg.model_dump(mode="json"), run_dir, trial_dir) as run:
        resume = resume_candidates(run_dir)[0] if resume_candidates(run_dir) else None
        resumed_at = int(resume.name.rsplit("_", 1)[1]) if resume else 0
        for row in history:
            if row["step"] <= resumed_at:
                run.log({k: v for k, v in row.items() if model_wide(k)})

        def report(metrics, checkpoint):
            run.log({k: v for k, v in metrics.items() if model_wide(k)})
            if metrics["step"] == crash_at:
                if kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise Crash

        Trainer(cfg, run_dir).fit(report=report, resume=run_dir if resume else None, on_event=run.event)


def test_a_crashed_trial_resumes_into_its_run_with_each_step_once(make_config, tmp_path):
    # e7m0 at a learning rate it cannot take: every step after the first few is non-finite and
    # skipped; a patience above the run keeps it going.
    cfg = make_config("quant.format=e7m0", "optim.lr=1000", f"train.max_steps={MAX_STEPS}",
                      f"train.checkpoint_interval={CHECKPOINT}", "train.eval_interval=4",
                      "train.diag_every=0", "train.shadow_every=0", "stability.nan_patience=100")
    trial_dir = tmp_path / "trial"
    with pytest.raises(Crash):
        attempt(cfg, trial_dir, crash_at=CRASH_AT)
    attempt(cfg, trial_dir, crash_at=None)  # resumes from the step-8 checkpoint

    runs = offline_runs(trial_dir)
    assert list(runs) == [run_id(SPEC.sweep_id, "e7m0-adamw-all-s42")]  # one run, both attempts
    (attempts,) = runs.values()
    assert len(attempts) == 2
    assert history_steps(attempts) == list(range(1, MAX_STEPS + 1))  # 9 and 10 were not logged twice
    assert history_steps(attempts[1:]) == [CRASH_AT + 1, CRASH_AT + 2]
    nan_skips = [a for a in alerts(attempts) if a.title.endswith("nan_skip")]
    skipped = [step for step, row in history_rows(attempts).items()
               if row["stability/loss_is_nan"] + row["stability/grad_has_nan"] > 0]
    assert len(skipped) >= 4  # a long NaN streak...
    assert len(nan_skips) == 2 and all(a.level == "WARN" for a in nan_skips)  # ...one alert per attempt
    assert "optimizer step skipped" in nan_skips[0].text


def test_a_killed_trial_loses_no_step_of_its_run(make_config, tmp_path):
    """SIGKILL mid-run (a lost spot instance): W&B had written none or few of the attempt's rows;
    the resumed attempt logs what the run directory holds beyond them, then trains on, and the run
    holds every step once."""
    cfg = make_config("quant.format=e4m3", f"train.max_steps={MAX_STEPS}", f"train.checkpoint_interval={CHECKPOINT}",
                      "train.eval_interval=4", "train.diag_every=0", "train.shadow_every=0")
    trial_dir = tmp_path / "trial"
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path; "
            "from altgrad.config import RunConfig; from test_wandb_runs import attempt; "
            f"attempt(RunConfig.model_validate_json(Path({str(tmp_path / 'config.json')!r}).read_text()), "
            f"Path({str(trial_dir)!r}), crash_at={CRASH_AT}, kill=True)")
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run = run_id(SPEC.sweep_id, "e7m0-adamw-all-s42")
    assert history_steps(offline_runs(trial_dir)[run]) != list(range(1, CRASH_AT + 1))  # W&B lost rows

    attempt(cfg, trial_dir, crash_at=None)  # resumes from the step-8 checkpoint
    attempts = offline_runs(trial_dir)[run]
    assert len(attempts) == 2
    assert history_steps(attempts) == list(range(1, MAX_STEPS + 1))
    logged = history_rows(attempts)
    on_disk = {int(r["step"]): r for r in read_jsonl(trial_dir / "run" / "metrics.jsonl")}
    assert all(logged[step]["train/loss"] == on_disk[step]["train/loss"] for step in logged)


def test_run_ids_differ_between_sweeps_and_trials():
    ids = {run_id(s, k) for s in ("exp@1", "exp@2", "other@1") for k in ("a", "b")}
    assert len(ids) == 6 and all(len(i) == 16 and not math.isnan(int(i, 16)) for i in ids)


def test_online_wandb_without_a_key_is_refused_before_any_trial(tmp_path, monkeypatch, capsys):
    """No API key (no WANDB_API_KEY, no `wandb login` in ~/.netrc): exit 2 with the fix, before
    Ray starts or anything is written. With a key in ~/.netrc the check passes."""
    from altgrad.tune.wandb_runs import missing_login

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ablation("--smoke", "--storage-path", str(tmp_path / "exp"), "--set", "wandb.enabled=true",
                    "--set", "wandb.mode=online") == 2
    err = capsys.readouterr().err
    assert "needs a W&B API key for api.wandb.ai" in err and "wandb login" in err
    assert not (tmp_path / "exp").exists()
    assert missing_login("offline") is None
    netrc = tmp_path / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert missing_login("online") is None
