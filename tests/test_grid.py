"""The grid of a format ablation (`altgrad.tune.grid`) as `--dry-run` prints it, without Ray running:
seeds, equivalent formats measured once, bf16 once per optimizer and seed, extra axes, resources."""

from __future__ import annotations

import pytest
import yaml
from sweep_helpers import ABLATION, CPU_STUDY, LR_SEARCH, dry_run

from altgrad.optim import OPTIMIZERS
from altgrad.tune.ablation import FormatAblation
from altgrad.tune.cli import sweep_main
from altgrad.tune.config import LrSearchConfig, SweepConfig, load_sweep_config
from altgrad.tune.lr_search import LrSearch


def test_default_grid(capsys, tmp_path):
    """Seeds by default, e1m6 measured by e0m7's trials, bf16 once per optimizer and seed, and
    the cpu preset's own (smaller) grid from `per_preset.cpu`."""
    n_opt = len(OPTIMIZERS)
    out = dry_run(capsys, "--storage-path", str(tmp_path), "--set", "preset=cpu")
    assert f"sweep format_ablation: {(7 * n_opt + n_opt) * 2} trials" in out
    assert f"less {2 * n_opt} points measured by an equivalent one" in out
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


def test_the_dry_run_says_each_format_s_own_settings(capsys):
    """A format run with settings of its own (grid.format_overrides) is said before the sweep runs,
    as the report says it after; an empty section (no setting) and a format outside the grid are not."""
    out = dry_run(capsys, "--smoke", "--set", "grid.formats=[bf16, e4m3, e5m2]", "--set",
                  "grid.format_overrides={e4m3: {optim: {lr: 0.001}, quant: {master_weights: format}}, e5m2: {},"
                  " e7m0: {optim: {lr: 0.1}}}")
    assert "settings by format (grid.format_overrides): e4m3: `optim.lr` = 0.001, " \
           "`quant.master_weights` = format\n" in out
    assert "settings by format" not in dry_run(capsys, "--smoke")


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
    assert "2 formats searched × 3 trials = 6 trials" in out


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
@pytest.mark.parametrize("smoke", [False, True])
@pytest.mark.parametrize("config", [ABLATION, CPU_STUDY, LR_SEARCH], ids=lambda p: p.stem)
def test_shipped_configs_do_not_warn(config, smoke, preset):
    """A shipped config, as run, warns about nothing: a warning printed before every sweep of a
    config the project ships (lr_search's smoke window once could not fill) teaches users to skip
    warnings."""
    model = LrSearchConfig if config == LR_SEARCH else SweepConfig
    assert load_sweep_config(model, config, [f"preset={preset}"], smoke=smoke).warnings() == []


def test_bf16_starts_first_wherever_the_config_lists_it():
    """ASHA holds a quantized trial at a rung until its bf16 has reached it, so bf16 listed last
    would let broken formats run on unjudged for as long as the whole group before it."""
    from altgrad.tune.grid import build_grid

    cfg = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", "grid.formats=[e5m2, e4m3, bf16]",
                                                    "grid.seeds=[1, 2]"], smoke=True)
    keys = [p.key for p in build_grid(cfg)]
    assert keys == ["bf16-adamw-all-s1", "e5m2-adamw-all-s1", "e4m3-adamw-all-s1",
                    "bf16-adamw-all-s2", "e5m2-adamw-all-s2", "e4m3-adamw-all-s2"]


def test_a_policy_rule_matching_no_layer_fails_before_the_sweep(capsys):
    """SPEC §3: a pattern that matches no layer is an error; the dry run (and so the sweep, before
    Ray starts) names it and the grid point, where every trial used to fail in its worker."""
    code = sweep_main(FormatAblation, ABLATION, "test", [
        "--dry-run", "--smoke", "--set", "grid.policies={mine: [{pattern: '*.attn.*', format: '{fmt}'}, "
        "{pattern: '*.mpl.*', format: '{fmt}'}]}", "--set", "grid.precisions=[mine]"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "grid point e4m3-adamw-mine-s42: quant.precision: layer pattern(s) ['*.mpl.*'] match no linear layer" in err


def test_axis_values_that_agree_to_six_digits_are_two_trials():
    """`:g` wrote 0.1234567 and 0.1234568 alike: one key, and the grid silently ran one of them."""
    from altgrad.tune.grid import build_grid

    cfg = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu", "grid.formats=[e4m3]",
                                                    "grid.axes={optim.lr: [0.1234567, 0.1234568, 0.002]}"],
                            smoke=True)
    keys = [p.key for p in build_grid(cfg)]
    assert keys == ["e4m3-adamw-all-lr=0.1234567-s42", "e4m3-adamw-all-lr=0.1234568-s42", "e4m3-adamw-all-lr=0.002-s42"]


def test_a_policy_that_is_a_preset_for_a_format_is_measured_once(capsys, tmp_path):
    """The config's own example policy puts attention in e5m2 and the rest in the grid's format:
    for e5m2 that quantizes every layer as `all` does, so its points are aliases of `all`'s (one
    measurement: run twice, the report counted it twice in each Holm family); for e3m4 it differs."""
    custom = tmp_path / "custom.yaml"
    data = yaml.safe_load(ABLATION.read_text())
    data["grid"] = {"formats": ["bf16", "e3m4", "e5m2"], "optimizers": ["adamw"], "precisions": ["all", "attn_e5m2"],
                    "seeds": [1, 2], "policies": {"attn_e5m2": [{"pattern": "*.attn.*", "format": "e5m2"},
                                                                {"pattern": "*", "format": "{fmt}"}]}}
    data["per_preset"] = {}
    custom.write_text(yaml.safe_dump(data))
    out = dry_run(capsys, "--config", str(custom), "--set", "preset=cpu")
    assert "sweep format_ablation: 8 trials" in out and "less 2 points measured by an equivalent one" in out
    for seed in (1, 2):
        assert (f"e5m2-adamw-attn_e5m2-s{seed}  e5m2   adamw     attn_e5m2 {seed}  = e5m2-adamw-all-s{seed} "
                "(the same layers in the same formats as precision all: one measurement)") in out
        assert f"e3m4-adamw-attn_e5m2-s{seed}  e3m4" in out and f"e3m4-adamw-attn_e5m2-s{seed}  e3m4   adamw     attn_e5m2 {seed}  =" not in out


@pytest.mark.parametrize("precisions", [["all", "mine"], ["mine", "all"]])
def test_equivalent_formats_and_equivalent_precisions_alias_one_measurement(capsys, tmp_path, precisions):
    """e1m6 is e0m7 under amax scaling, and `mine` (every layer in the grid's format, spelled out) is
    `all`: of the four points of a seed only the first runs, whichever order the grid lists them in
    (an alias of an alias measured nothing: e1m6 ran again under one of the precisions)."""
    custom = tmp_path / "custom.yaml"
    data = yaml.safe_load(ABLATION.read_text())
    data["grid"] = {"formats": ["bf16", "e0m7", "e1m6"], "optimizers": ["adamw"], "precisions": precisions,
                    "seeds": [1], "policies": {"mine": [{"pattern": "*", "format": "{fmt}"}]}}
    data["per_preset"] = {}
    custom.write_text(yaml.safe_dump(data))
    out = dry_run(capsys, "--config", str(custom), "--set", "preset=cpu")
    first = precisions[0]
    assert "sweep format_ablation: 2 trials" in out and "less 3 points measured by an equivalent one" in out
    assert f"= e0m7-adamw-{first}-s1 (equivalent format: one measurement)" in out
    (line,) = [x for x in out.splitlines() if x.strip().startswith(f"e1m6-adamw-{precisions[1]}-s1 ")]
    assert line.endswith(f"= e0m7-adamw-{first}-s1 (equivalent format; the same layers in the same formats as "
                         f"precision {first}: one measurement)")
