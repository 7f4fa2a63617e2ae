"""The sweep config (`altgrad.tune.config`) without Ray running: a malformed config or YAML file
exits 2 naming the field, before anything is written."""

from __future__ import annotations

import pytest
from sweep_helpers import ablation


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
    (["stopper.nan_patience=3"], "stopper: stopper.nan_patience moved to base.stability.nan_patience"),
    (["stopper.stall_threshold=0.9"], "stopper.stall_threshold moved to base.stability.stall_stop"),
    (["stopper.stall_reports=8"], "stopper.stall_reports moved to base.stability.stall_stop_reports"),
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
