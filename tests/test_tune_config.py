"""The sweep config (`altgrad.tune.config`) without Ray running: a malformed config or YAML file
exits 2 naming the field, before anything is written."""

from __future__ import annotations

import re

import pytest
import yaml
from sweep_helpers import ABLATION, LR_SEARCH, ablation

from altgrad.config import ConfigError, build_run_config
from altgrad.tune.cli import sweep_main
from altgrad.tune.config import LrSearchConfig, SweepConfig, load_sweep_config
from altgrad.tune.grid import build_grid, describe_grid
from altgrad.tune.lr_search import LrSearch
from altgrad.tune.trial_spec import trial_limits, trial_run_config


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
    (["preset=[a]"], "unknown preset ['a']; choose one of ['cpu', 'gpu']"),
    (["base.optim.lr=inf"], "base.optim.lr: Input should be a finite number"),
    (["stoper.nan_patience=3"], "stoper: unknown field"),
    (["stopper.nan_patience=3"], "stopper: stopper.nan_patience moved to base.stability.nan_patience"),
    (["stopper.stall_threshold=0.9"], "stopper.stall_threshold moved to base.stability.stall_stop"),
    (["stopper.stall_reports=8"], "stopper.stall_reports moved to base.stability.stall_stop_reports"),
    (["base.preset=gpu"], "base: set the sweep's top-level `preset`"),
    (["per_preset.gpu.base.train.batch_size=0"], "under preset gpu (with per_preset.gpu)"),
    # a typo in this preset's section, or in the smoke section of a run without --smoke, names it
    (["per_preset.cpu.bse={}"], "with per_preset.cpu: invalid configuration:\n  bse: unknown field"),
    (["smoke.asah={}"], "with --smoke (the smoke: section): invalid configuration:\n  asah: unknown field"),
    (["grid.axes={quant.roundin: [nearest]}"], "grid.axes: 'quant.roundin': quant has no field 'roundin'"),
    (["grid.axes={quant.rounding: [nearest, upward]}"], "grid.axes.quant.rounding: value 'upward' is not valid"),
    (["grid.axes={quant.format: [e4m3, e5m2]}"], "'quant.format' is a fixed axis of the grid: set it with grid.formats"),
    (["grid.axes={train.threads: [1, 2]}"],
     "'train.threads' is a fixed axis of the grid: set it with resources.cpus_per_trial"),
    (["grid.axes={quant.scaling: [none]}"], "'quant.scaling' is a section"),
    (["grid.axes={optim.lr: []}"], "optim.lr: give at least one value"),
    (["base.quant.grad_format=e8m8"], "base.quant.grad_format"),
    (["base.train.warmup_steps=3000"], "base: train.warmup_steps (3000) must be below train.max_steps"),
    (["grid.seeds=[42, 43, 42]"], "grid: duplicate seed(s) [42]"),
    (["grid.optimizers=[]"], "grid.optimizers: give at least one optimizer name, or 'all'"),
    # YAML reads 1e-2 (no dot) as a string; the run config reads it as 0.01: one setting, twice
    (["grid.axes={optim.lr: [0.01, 1e-2]}"], "grid.axes.optim.lr: values 0.01 and '1e-2' are the same setting (0.01)"),
    (["grid.axes={optim.weight_decay: [0, 0.0]}"], "grid.axes.optim.weight_decay: values 0 and 0.0 are the same setting"),
    (["base.train.max_steps=true"], "base.train.max_steps: a number, not true"),  # not 1
    (["asha.tolerance=false"], "asha.tolerance: a number, not false"),
    (["asha.metric=train/foo"], "asha.metric: 'train/foo' is not in every report of a trial"),
    (["asha.metric=quant/bit_stall_rate"], "asha.metric: 'quant/bit_stall_rate' is not in every report"),
    # what the report says a format ran with must be what it ran with: no setting the grid replaces
    (["grid.format_overrides={e4m3: {optim: {name: manifold}}}"],
     "format_overrides.e4m3: 'optim.name' is set by the grid (grid.optimizers)"),
    (["grid.format_overrides={bf16: {quant: {master_weights: format}}}"],
     "format_overrides.bf16: 'quant.master_weights' is set by the grid (bf16 stores no weights in a format)"),
    (["grid.format_overrides={e4m3: {optim: {lr: 1.0e-3}}}", "grid.axes={optim.lr: [2.0e-3, 4.0e-3]}"],
     "format_overrides.e4m3: 'optim.lr' is also an extra axis (grid.axes)"),
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


@pytest.mark.parametrize("override, line", [
    ("base.quant.precision=5", "base.quant.precision: not a layer precision: give one of "),
    ("grid.optimizers=adamw", "grid.optimizers: give 'all' or a list of optimizer names"),
    ("grid.axes={quant.rounding: [[nearest]]}",
     "grid.axes.quant.rounding.0: not a scalar: give a string, a number or true/false"),
])
def test_a_value_of_the_wrong_kind_for_a_union_is_one_error(override, line):
    """A setting that takes one of several kinds reports a value of none of them once, not once per
    kind it is not."""
    with pytest.raises(ConfigError) as err:
        load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", override])
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"  {line}")


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
    bad.write_bytes(b"name: caf\xe9\n")  # Latin-1
    assert ablation("--config", str(bad), "--dry-run") == 2
    err = capsys.readouterr().err
    assert "bad.yaml: line 1 is not UTF-8 text" in err and "Traceback" not in err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("name", [".", "..", "..."])
def test_a_name_of_dots_only_is_refused(name):
    """`.` fits the name pattern but is the storage folder itself (`--fresh` moved all of it aside),
    `..` its parent."""
    with pytest.raises(ConfigError, match=f"name: '{re.escape(name)}' names the storage path itself or a folder above it"):
        load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", f"name='{name}'"])


def test_built_in_precisions_are_named_in_any_case():
    """As in a run's quant.precision (and as format names are); a policy may not take a built-in's
    name in another case, which would now name the built-in."""
    cfg = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", "grid.precisions=[ALL, Mlp]"])
    assert cfg.grid.precisions == ["all", "mlp"]
    assert load_sweep_config(LrSearchConfig, LR_SEARCH, ["preset=cpu", "precision=MLP"]).precision == "mlp"
    with pytest.raises(ConfigError, match=r"policies: \['MLP'\] would shadow the built-in precisions"):
        load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", "grid.policies={MLP: [{pattern: '*', format: e5m2}]}"])


def test_base_settings_the_sweep_overrides_are_warned_about(capsys):
    """A `base` setting that no trial (or not every trial) uses is legal but probably not meant:
    the sweep says so before it runs, and before its dry run."""
    assert ablation("--dry-run", "--smoke", "--set", "base.quant.format=e5m2", "--set", "base.optim.name=manifold",
                    "--set", "base.quant.precision=mlp", "--set", "base.train.seed=3",
                    "--set", "base.quant.master_weights=format", "--set", "base.train.threads=4") == 0
    err = capsys.readouterr().err
    for path, key in (("quant.format", "grid.formats"), ("optim.name", "grid.optimizers"),
                      ("quant.precision", "grid.precisions"), ("train.seed", "grid.seeds"),
                      ("train.threads", "resources.cpus_per_trial")):
        assert f"warning: base.{path} is not used: {key} sets it in every trial" in err
    assert "warning: base.quant.master_weights is format, but bf16 has no 8-bit format" in err
    # without grid.seeds the base seed is the one that runs; without bf16 nothing is forced
    assert ablation("--dry-run", "--smoke", "--set", "grid.seeds=null", "--set", "base.train.seed=3",
                    "--set", "grid.formats=[e4m3]", "--set", "base.quant.master_weights=format") == 0
    assert "warning" not in capsys.readouterr().err
    assert sweep_main(LrSearch, LR_SEARCH, "test", ["--dry-run", "--smoke", "--set", "base.optim.lr=0.01",
                                                    "--set", "base.train.threads=4"]) == 0
    err = capsys.readouterr().err
    assert "warning: base.optim.lr is not used: the search over lr sets it in every trial" in err
    assert "warning: base.train.threads is not used: resources.cpus_per_trial sets it in every trial" in err


def test_a_trial_computes_with_its_cpus_as_threads_whatever_its_run_says():
    run = build_run_config({"preset": "cpu"}, ["train.threads=8"]).model_dump(mode="json")
    for cpus in (1, 3):
        assert trial_run_config({"key": "k", **trial_limits(cpus, 0.0)}, run).train.threads == cpus


def test_set_reaches_the_smoke_and_preset_sections_it_names():
    """`--set smoke.grid.formats=[…]` with --smoke sets what the smoke run trains (it was written into
    the smoke section after that section had been applied, and changed nothing); a plain `--set`
    still comes after the smoke section, and a preset's section takes its own `--set` too."""
    smoke = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", "smoke.grid.formats=[e5m2]",
                                                     "per_preset.cpu.base.train.diag_every=3"], smoke=True)
    assert smoke.grid.formats == ["e5m2"] and smoke.base["train"]["diag_every"] == 3
    plain = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", "smoke.grid.formats=[e5m2]"])
    assert len(plain.grid.formats) > 1  # the config's own: no --smoke, no smoke section
    last = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", "smoke.grid.formats=[e5m2]",
                                                    "grid.formats=[e3m4]"], smoke=True)
    assert last.grid.formats == ["e3m4"]


@pytest.mark.parametrize("override, line", [
    ("lr.grid=[0.01, 1e-2]", "lr.grid: duplicate learning rate(s) [0.01]"),
    ("tolerance=1", "tolerance: Input should be less than 1"),  # nothing could ever be stable
])
def test_an_lr_search_refuses_a_grid_rate_twice_and_an_unmeetable_tolerance(override, line):
    """Two grid points at one rate would share a trial key (the sweep would never read as finished)."""
    with pytest.raises(ConfigError, match=re.escape(line)):
        load_sweep_config(LrSearchConfig, LR_SEARCH, ["preset=cpu", override])


def test_a_grid_whose_asha_has_no_rung_is_warned_about():
    cfg = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", "base.train.max_steps=40", "asha.grace_period=40"])
    assert ("asha.grace_period (40) is not below the trials' 40 steps: ASHA has no rung and stops no trial "
            "(the stability stopper still does)") in cfg.warnings()
    assert not any("grace_period" in w for w in load_sweep_config(
        SweepConfig, ABLATION, ["preset=cpu", "base.train.max_steps=41", "asha.grace_period=40"]).warnings())


def test_a_budget_no_checkpoint_falls_inside_is_warned_about():
    """`--set base.train.max_steps=30` at the cpu preset (checkpoints every 40): no trial saves a
    checkpoint before its end, so a killed sweep redoes every trial it had started."""
    warned = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", "base.train.max_steps=30"]).warnings()
    assert ("base.train.checkpoint_interval (40) is not below the trials' 30 steps: a trial saves no checkpoint "
            "before its end, so one interrupted starts over (lower base.train.checkpoint_interval)") in warned
    assert not any("checkpoint_interval" in w for w in load_sweep_config(
        SweepConfig, ABLATION, ["preset=cpu", "base.train.max_steps=41"]).warnings())


def test_a_rung_before_the_first_evaluation_is_warned_about():
    """A rung before the first evaluation after step 1 reads the val loss of step 1: it judges a
    trial by where it started (the gpu preset's rung at step 20 did, evaluating every 50)."""
    warned = load_sweep_config(SweepConfig, ABLATION, ["preset=gpu", "asha.grace_period=20",
                                                       "asha.reduction_factor=2"]).warnings()
    assert [w for w in warned if "ASHA's rung" in w] == [
        "ASHA's rungs at step 20, 40 come before the first evaluation after step 1 (train.eval_interval 50): "
        "they judge each trial by its loss at step 1, not by what it learned (set asha.grace_period to at least 50)"]
    for fine in (["asha.grace_period=50"], ["asha.grace_period=20", "asha.enabled=false"]):
        assert not any("ASHA's rung" in w for w in load_sweep_config(
            SweepConfig, ABLATION, ["preset=gpu", *fine]).warnings())


def test_the_gpu_preset_trains_on_the_corpus_and_the_cpu_preset_on_the_fixture():
    """The research plan's model for 2000 steps would pass 3.3 times over the 354 documents of the
    jsonl fixture: the gpu preset reads multi_eurlex (`hf`), the cpu preset the fixture."""
    sources = {preset: load_sweep_config(SweepConfig, ABLATION, [f"preset={preset}"]).base_run.data.source
               for preset in ("gpu", "cpu")}
    assert sources["gpu"] == "hf" and sources["cpu"].startswith("jsonl:")


def test_a_set_for_this_preset_is_not_checked_against_the_other_presets_section(tmp_path):
    """`--set base.train.max_steps=40` on the cpu preset is fine, though under the gpu preset's
    section (warmup 100) it would be invalid; a typo in that section still fails (above). A config
    without a smoke section checks the other preset's too (it read as `smoke: null`)."""
    cfg = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", "base.train.max_steps=40"])
    assert cfg.base_run.train.max_steps == 40
    doc = yaml.safe_load(ABLATION.read_text())
    del doc["smoke"]
    (tmp_path / "no_smoke.yaml").write_text(yaml.safe_dump(doc))
    for preset in ("cpu", "gpu"):
        assert load_sweep_config(SweepConfig, tmp_path / "no_smoke.yaml", [f"preset={preset}"]).smoke == {}
    # a field the file leaves to --set (an lr search's `lr`) is completed for every preset's check
    doc = yaml.safe_load(LR_SEARCH.read_text())
    del doc["lr"]
    (tmp_path / "no_lr.yaml").write_text(yaml.safe_dump(doc))
    lr = "lr={grid: [1.0e-3, 1.0e-2], low: 1.0e-4, high: 1.0, samples: 1}"
    for preset in ("cpu", "gpu"):
        assert load_sweep_config(LrSearchConfig, tmp_path / "no_lr.yaml", [f"preset={preset}", lr]).lr.grid == [1e-3, 1e-2]


def test_a_format_given_more_steps_than_bf16_is_warned_about():
    """Its cells would have no bf16 seed evaluated at their budget: the report compares them with
    nothing. Fewer steps, or bf16 given the same, is fine."""
    base = ["preset=cpu", "base.train.max_steps=40", "grid.formats=[bf16, e4m3, e5m2]"]
    cfg = load_sweep_config(SweepConfig, ABLATION, [*base, "grid.format_overrides={e5m2: {train: {max_steps: 50}}}"])
    assert [w for w in cfg.warnings() if "format_overrides" in w] == [
        "grid.format_overrides.e5m2 trains 50 steps, past bf16's 40: no bf16 seed is evaluated at its budget, so "
        "the report compares e5m2 with nothing (give bf16 the same train.max_steps)"]
    assert "each trial: up to 50 steps of a" in describe_grid(cfg, build_grid(cfg))  # the longest, not the base's
    for fine in ("{e5m2: {train: {max_steps: 30}}}", "{e5m2: {train: {max_steps: 50}}, bf16: {train: {max_steps: 50}}}"):
        cfg = load_sweep_config(SweepConfig, ABLATION, [*base, f"grid.format_overrides={fine}"])
        assert not any("format_overrides" in w for w in cfg.warnings())
