"""Sweep configs without Ray running: `--dry-run` grids and resources, malformed configs, and
what a re-run of an existing experiment does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from altgrad.experiment import STATE_DIR, SWEEP_FILE
from altgrad.optim import OPTIMIZERS
from altgrad.tune.ablation import FormatAblation
from altgrad.tune.cli import sweep_main
from altgrad.tune.lr_search import LrSearch

ROOT = Path(__file__).resolve().parents[1]
ABLATION = ROOT / "sweeps" / "configs" / "format_ablation.yaml"
LR_SEARCH = ROOT / "sweeps" / "configs" / "lr_search.yaml"


def ablation(*args: str) -> int:
    return sweep_main(FormatAblation, ABLATION, "test", list(args))


def dry_run(capsys, *args: str, kind=FormatAblation, config=ABLATION) -> str:
    assert sweep_main(kind, config, "test", ["--dry-run", *args]) == 0
    return capsys.readouterr().out


def test_default_grid(capsys, tmp_path):
    """Seeds by default, e1m6 measured by e0m7's trials, bf16 once per optimizer and seed, and
    the cpu preset's own (smaller) grid from `per_preset.cpu`."""
    n_opt = len(OPTIMIZERS)
    out = dry_run(capsys, "--storage-path", str(tmp_path), "--set", "preset=cpu")
    assert f"sweep format_ablation: {(7 * n_opt + n_opt) * 2} trials" in out
    assert f"less {2 * n_opt} equivalent-format points measured once" in out
    assert "e1m6-adamw-all-s43" in out and "= e0m7-adamw-all-s43 (equivalent format" in out
    assert "per trial 1 CPU, 0 GPU" in out
    assert f"experiment dir: {tmp_path}/format_ablation" in out
    assert out.count("bf16-") == 2 * n_opt and "e7m0-manifold-all-s43" in out
    assert "estimated wall time" in out and "stored: estimate.step_time_s.cpu" in out
    assert not (tmp_path / "format_ablation").exists()
    gpu = dry_run(capsys, "--storage-path", str(tmp_path), "--set", "preset=gpu")
    assert f"sweep format_ablation: {(7 * n_opt * 4 + n_opt) * 2} trials" in gpu
    assert "up to 2000 steps of a 6-layer, 384-wide model" in gpu
    assert "GPU-hours" in gpu and "$" in gpu


def test_scaling_none_runs_both_twins(capsys, tmp_path):
    out = dry_run(capsys, "--smoke", "--set", "grid.formats=[e0m7, e1m6, e4m3]",
                  "--set", "base.quant.scaling.mode=none")
    assert "3 trials" in out and "equivalent" not in out
    out = dry_run(capsys, "--smoke", "--set", "grid.formats=[e0m7, e1m6, e4m3]")
    assert "2 trials" in out and "= e0m7-adamw-all-s42" in out
    # an axis over the scaling mode: twins measured once only where amax scaling is on
    out = dry_run(capsys, "--smoke", "--set", "grid.formats=[e0m7, e1m6]",
                  "--set", "grid.axes={quant.scaling.mode: [none, delayed]}")
    assert "3 trials" in out
    assert "e1m6-adamw-all-mode=delayed-s42" in out and "= e0m7-adamw-all-mode=delayed-s42" in out


def test_extra_axes_in_the_grid(capsys, tmp_path):
    out = dry_run(capsys, "--smoke", "--set", "grid.seeds=[1, 2]",
                  "--set", "grid.axes={quant.rounding: [nearest, stochastic], optim.lr: [0.001, 0.002]}")
    # bf16 runs per lr (applies) but not per rounding (quant.* does not apply to it)
    assert "sweep format_ablation-smoke: 20 trials = 2 formats × 1 optimizer × 1 precision × 2 " \
           "quant.rounding × 2 optim.lr + bf16 × 1 optimizer × 2 optim.lr, × 2 seeds" in out
    assert "e4m3-adamw-all-rounding=stochastic-lr=0.002-s2" in out
    assert "bf16-adamw-all-lr=0.001-s1" in out and "bf16-adamw-all-rounding" not in out
    assert sweep_main(FormatAblation, ABLATION, "test", ["--dry-run", "--smoke", "--set", "base.optim.lr=0.001",
                                                         "--set", "grid.axes={optim.lr: [0.001, 0.002]}"]) == 0
    assert "warning: grid.axes.optim.lr overrides base.optim.lr in every trial" in capsys.readouterr().err
    from altgrad.tune.config import SweepConfig, load_sweep_config
    from altgrad.tune.grid import build_grid

    cfg = load_sweep_config(SweepConfig, ABLATION, ["grid.axes={quant.rounding: [nearest, stochastic]}",
                                                    "preset=cpu"], smoke=True)
    points = {p.key: p for p in build_grid(cfg)}
    stochastic = points["e4m3-adamw-all-rounding=stochastic-s42"]
    assert stochastic.run["quant"]["rounding"] == "stochastic"
    assert stochastic.axes == {"quant.rounding": "stochastic"}
    assert stochastic.reference == "bf16-adamw-all-s42"
    assert points["bf16-adamw-all-s42"].axes == {}


def test_smoke_gpu_and_custom_grids(capsys, tmp_path):
    out = dry_run(capsys, "--smoke", "--storage-path", str(tmp_path))
    assert "sweep format_ablation-smoke: 3 trials" in out

    out = dry_run(capsys, "--smoke", "--set", "preset=gpu", "--set", "max_concurrent_trials=3")
    assert "per trial 1 CPU, 0.25 GPU, max 3 at once" in out

    custom = tmp_path / "custom.yaml"
    data = yaml.safe_load(ABLATION.read_text())
    data["grid"] = {"formats": ["e4m3", "e5m2"], "optimizers": ["adamw"], "precisions": ["mlp", "heads"],
                    "seeds": [1, 2],
                    "policies": {"heads": [{"pattern": "lm_head", "format": "e5m2"},
                                           {"pattern": "*", "format": "{fmt}"}]}}
    data["per_preset"] = {}  # else its cpu section's grid.precisions would win
    custom.write_text(yaml.safe_dump(data))
    out = dry_run(capsys, "--config", str(custom), "--set", "resources.cpus_per_trial=2", "--set", "preset=cpu")
    assert "8 trials = 2 formats × 1 optimizer × 2 precisions, × 2 seeds" in out
    assert "per trial 2 CPU" in out and "e4m3-adamw-heads-s2" in out

    out = dry_run(capsys, "--smoke", kind=LrSearch, config=LR_SEARCH)
    assert "2 formats × 3 trials = 6 trials" in out


@pytest.mark.parametrize("overrides, field", [
    (["grid.formats=[e4m3, e9m9]"], "grid.formats: unknown format 'e9m9'"),
    (["grid.optimizers=[adamw, sgd]"], "grid.optimizers: unknown optimizer(s) ['sgd']"),
    (["grid.precisions=[all, embeddings]"], "grid: precisions: unknown ['embeddings']"),
    (["base.optim.lr=-1"], "base.optim.lr: Input should be greater than 0"),
    (["base.train.max_stepz=3"], "base.train.max_stepz: unknown field"),
    (["asha.reduction_factor=1"], "asha.reduction_factor: Input should be greater than 1"),
    (["resources.gpu_per_trial=-0.5"], "resources.gpu_per_trial: Input should be greater than or equal to 0"),
    (["wandb.mode=sometimes"], "wandb.mode: Input should be 'offline', 'online' or 'disabled'"),
    (["name=a/b"], "name: String should match pattern"),
    (["stoper.nan_patience=3"], "stoper: unknown field"),
    (["base.preset=gpu"], "base: set the sweep's top-level `preset`"),
    (["per_preset.gpu.base.train.batch_size=0"], "under preset gpu (with per_preset.gpu)"),
    (["grid.axes={quant.roundin: [nearest]}"], "grid.axes: 'quant.roundin': quant has no field 'roundin'"),
    (["grid.axes={quant.rounding: [nearest, upward]}"], "grid.axes.quant.rounding: value 'upward' is not valid"),
    (["grid.axes={quant.format: [e4m3, e5m2]}"], "'quant.format' is a fixed axis of the grid: set it with grid.formats"),
    (["grid.axes={quant.scaling: [none]}"], "'quant.scaling' is a section"),
    (["grid.axes={optim.lr: []}"], "optim.lr: give at least one value"),
    (["base.quant.grad_format=e8m8"], "base.quant.grad_format"),
    (["base.train.warmup_steps=3000"], "base: train.warmup_steps (3000) must be below train.max_steps"),
])
def test_malformed_config_exits_2_naming_the_field(overrides, field, tmp_path, capsys):
    args = ["--storage-path", str(tmp_path / "store"), "--set", "preset=cpu"]
    for o in overrides:
        args += ["--set", o]
    assert ablation(*args) == 2
    err = capsys.readouterr().err
    assert field in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "store").exists()


def test_malformed_yaml_files(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngrid: [unclosed\n")
    assert ablation("--config", str(bad), "--storage-path", str(tmp_path / "s")) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert ablation("--config", str(tmp_path / "missing.yaml")) == 2
    assert "config file not found" in capsys.readouterr().err
    bad.write_text("- a list\n")
    assert ablation("--config", str(bad)) == 2
    assert "expected a mapping" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def existing(tmp_path, status: str, **config_changes) -> Path:
    """An experiment dir as a finished/interrupted sweep leaves it (its sweep.json)."""
    from altgrad.tune.config import SweepConfig, load_sweep_config

    cfg = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu"], storage_path=str(tmp_path))
    doc = cfg.model_dump(mode="json")
    doc["base"] = {**doc["base"], **config_changes}
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


def test_lr_search_table():
    from altgrad.experiment import TrialRecord
    from altgrad.tune.lr_search import render_lr_table, stable_lr_row

    def trial(lr: float, vals: list[float], reason: str = "completed") -> TrialRecord:
        history = [{"step": i + 1, "val/loss": v, "val/step": i + 1} for i, v in enumerate(vals)]
        return TrialRecord(trial_id=str(lr), format="e4m3", optimizer="adamw", precision="all",
                           status="TERMINATED", stop_reason=reason, history=history,
                           summary={"final_val_loss": vals[-1]}, params={"lr": lr})

    records = [trial(1e-3, [10, 8]), trial(1e-2, [10, 7]), trial(3e-2, [10, 11]),
               trial(1e-1, [10, float("inf")], "nan"), trial(5e-3, [10, 9], "bit_stall")]
    row = stable_lr_row("e4m3", records)
    assert row == {"format": "e4m3", "largest_stable_lr": 1e-2, "val_loss_there": 7,
                   "smallest_unstable_lr": 5e-3, "trials": 5, "unfinished": 0}
    assert "e4m3" in render_lr_table([row]) and "0.01" in render_lr_table([row])


def test_dry_run_estimate_arithmetic(monkeypatch, capsys):
    """Wall time = sum over trials of (overhead + start-up + steps x step + evals x eval) / trials
    at a time; GPU-hours = trial time x GPU per trial; with known per-step costs."""
    from altgrad.tune import estimate

    costs = {"bf16": estimate.StepCost(0.1, 1.0, 5.0, "measured"),
             "e4m3": estimate.StepCost(0.2, 2.0, 7.0, "measured")}
    monkeypatch.setattr(estimate, "measure", lambda run, steps, threads: costs[
        "bf16" if run.quant.format == "bf16" else "e4m3"])
    out = dry_run(capsys, "--smoke", "--set", "estimate.measure_steps=6", "--set", "estimate.trial_overhead_s=3",
                  "--set", "preset=cpu", "--set", "grid.formats=[bf16, e4m3, e5m2]")
    # smoke: 20 steps, eval every 5 -> 20 // 5 + 2 = 6 evaluations; 2 trials at a time on 2 cores
    bf16 = 3 + 5 + 20 * 0.1 + 6 * 1.0
    quantized = 3 + 7 + 20 * 0.2 + 6 * 2.0
    assert f"estimated wall time: {(bf16 + 2 * quantized) / 2:.0f} s for 3 trials" in out
    assert "measured here over 6 steps (bf16 100 ms/step, eval 1.00 s" in out

    gpu = dry_run(capsys, "--smoke", "--set", "preset=gpu", "--set", "estimate.step_time_s.gpu=0.05",
                  "--set", "estimate.usd_per_gpu_hour=4", "--set", "estimate.trial_overhead_s=10")
    step = 0.05  # stored: an eval batch is a third of a step; gpu smoke evaluates 20 batches
    trial = 10 + 20 * step + 6 * 20 * step / 3
    hours = 3 * trial * 0.25 / 3600
    assert f"GPU time: {hours:.2f} GPU-hours (0.25 GPU per trial) = ${hours * 4:.2f} at $4/GPU-hour" in gpu


@pytest.mark.usefixtures("eager_kernels")  # the compiled kernels are tested elsewhere
def test_measured_step_cost_is_timed_here(make_config):
    from altgrad.tune.estimate import measure

    cost = measure(make_config("quant.format=e4m3", "train.max_steps=30"), steps=6, threads=1)
    assert cost.source == "measured" and 0 < cost.step_s < 5 and cost.eval_s >= 0 and cost.startup_s > 0


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
