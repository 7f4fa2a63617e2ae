"""Config loading: presets, YAML, --set overrides and readable validation errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from altgrad.config import (
    ConfigError,
    ModelConfig,
    RunConfig,
    build_run_config,
    dump_config,
    load_config,
)
from altgrad.quant.linear import ROLES


def test_presets_layer_under_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: gpu\noptim:\n  lr: 3.0e-4\nquant:\n  format: E5M2\n")
    cfg = load_config(path, ["optim.lr=1e-3", "train.max_steps=700"])
    assert cfg.preset == "gpu" and cfg.model.n_embd == 384 and cfg.model.block_size == 256
    assert cfg.optim.lr == 1e-3 and cfg.train.max_steps == 700 and cfg.quant.format == "e5m2"
    cpu = build_run_config({"preset": "cpu"})
    assert (cpu.model.n_layer, cpu.model.n_embd, cpu.model.block_size, cpu.train.batch_size) == (
        2,
        64,
        64,
        8,
    )


def test_dump_round_trips(tmp_path):
    cfg = build_run_config(
        {"preset": "cpu"}, ["quant.precision=[{pattern: '*.mlp.*', format: e2m5}]"]
    )
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg
    assert isinstance(cfg, RunConfig) and cfg.quant.precision[0].format == "e2m5"


@pytest.mark.parametrize(
    ("override", "field", "hint"),
    [
        ("quant.format=fp8", "quant.format", "e5m2"),  # the error lists valid names
        ("quant.grad_format=e3m3", "quant.grad_format", "X + Y = 7"),
        ("optim.lr=-1", "optim.lr", "greater than 0"),
        ("optim.name=sgd", "optim.name", "adamw"),
        ("model.n_head=5", "model", "divisible"),
        ("train.max_step=3", "train.max_step", "unknown field"),
        ("quant.master_weights=format", "quant", "bf16"),
        ("quant.roles.grad=false", "quant.roles.grad", "unknown field"),
        ("quant.roles={input: false, weight: false, grad_output: false}", "quant", "at least one"),
        ("quant.roles.weight=false", "quant", "roles.weight"),  # with master_weights=format
        ("quant.grad_scaling.mode=off", "quant.grad_scaling.mode", "'delayed'"),
        ("quant.scaling.history_len=0", "quant.scaling", "history_len must be >= 1"),  # ScalingPolicy's rule
        ("train.eval_iters=0", "train.eval_iters", "greater than or equal to 1"),
        ("optim.lr=inf", "optim.lr", "finite number"),  # gt=0 alone lets infinity through
        ("stability.kurtosis_warn=nan", "stability.kurtosis_warn", "finite number"),
        ("preset=[a]", "unknown preset ['a']", "choose one of ['cpu', 'gpu']"),  # not hashable
        ("preset={a: 1}", "unknown preset {'a': 1}", "choose one of"),
    ],
)
def test_invalid_fields_are_named(override, field, hint):
    extra = {"quant.master_weights=format": ["quant.format=bf16"],
             "quant.roles.weight=false": ["quant.master_weights=format"]}.get(override, [])
    with pytest.raises(ConfigError) as err:
        build_run_config({"preset": "cpu"}, [*extra, override])
    assert field in str(err.value) and hint in str(err.value)


def test_roles_and_grad_scaling():
    """Every role is on by default; the baseline may switch them all off (it quantizes nothing
    anyway); grad_scaling takes the fields it does not set from scaling, and round-trips."""
    cfg = build_run_config({"preset": "cpu"})
    assert cfg.quant.roles.enabled == ROLES  # one field per role, in the layer's order
    assert cfg.quant.grad_scaling == cfg.quant.scaling
    off = build_run_config({"preset": "cpu"}, ["quant.roles.grad_output=false"])
    assert off.quant.roles.enabled == ("input", "weight")
    baseline = build_run_config({"preset": "cpu"}, [
        "quant.format=bf16", "quant.roles={input: false, weight: false, grad_output: false}"])
    assert baseline.quant.roles.enabled == ()
    both = build_run_config({"preset": "cpu"}, ["quant.scaling.mode=dynamic", "quant.scaling.history_len=4"])
    assert both.quant.grad_scaling.mode == "dynamic" and both.quant.grad_scaling.history_len == 4
    grad = build_run_config({"preset": "cpu"}, ["quant.scaling.history_len=4", "quant.grad_scaling.mode=none"])
    assert grad.quant.scaling.mode == "delayed" and grad.quant.grad_scaling.mode == "none"
    assert grad.quant.grad_scaling.history_len == 4
    assert build_run_config(yaml.safe_load(dump_config(grad))) == grad
    with pytest.raises(ConfigError, match="manifold steps weights in ULPs of their format"):
        build_run_config({"preset": "cpu"}, ["optim.name=manifold", "quant.roles.weight=false"])


def test_malformed_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["optim.lr"])
    bad.write_bytes(b"preset: cpu\n# caf\xe9 in Latin-1\n")
    with pytest.raises(ConfigError, match="bad.yaml: line 2 is not UTF-8 text"):
        load_config(bad)
    bad.write_text("preset: [a]\n")
    with pytest.raises(ConfigError, match=r"unknown preset \['a'\]"):
        load_config(bad)
    # a sweep's config given to a run says so (each of its keys was an "unknown field")
    with pytest.raises(ConfigError, match=r"ablation.yaml is a sweep config \(it has base, grid\), not a run config"):
        load_config(Path(__file__).parents[1] / "sweeps" / "configs" / "format_ablation.yaml")


def test_precision_names_are_case_insensitive_and_an_unknown_one_is_one_error():
    """As format names are: `MLP` is `mlp`. An unknown name is one line listing the names, not a
    second one saying that it is no list of rules either."""
    assert build_run_config({"preset": "cpu"}, ["quant.precision=MLP"]).quant.precision == "mlp"
    with pytest.raises(ConfigError) as err:
        build_run_config({"preset": "cpu"}, ["quant.precision=foo"])
    assert str(err.value) == ("invalid configuration:\n  quant.precision: unknown precision 'foo'; use one of "
                              "['all', 'mlp', 'attn', 'no_head'] or a list of {pattern, format} rules")


@pytest.mark.parametrize("value", ["5", "true", "null", "{all: 1}"])
def test_a_precision_of_the_wrong_kind_is_one_error(value):
    """Neither a name nor a list of rules: one line saying what is expected, not one per member of
    the union ('not a valid string', 'not a valid list'); a bad rule is that rule's error alone."""
    with pytest.raises(ConfigError) as err:
        build_run_config({"preset": "cpu"}, [f"quant.precision={value}"])
    assert str(err.value) == ("invalid configuration:\n  quant.precision: not a layer precision: give one of "
                              "['all', 'mlp', 'attn', 'no_head'] or a list of {pattern, format} rules")
    with pytest.raises(ConfigError) as err:
        build_run_config({"preset": "cpu"}, ["quant.precision=[{pattern: '*'}]"])
    assert str(err.value) == "invalid configuration:\n  quant.precision.0.format: Field required"


def test_model_config_builds_the_models_own_config():
    """The run config validates exactly the architecture's fields: one added to GPTConfig but not
    to ModelConfig (or the reverse) fails here, as does a default that drifts between them."""
    import dataclasses

    from altgrad.model import GPTConfig

    arch = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    assert ModelConfig().model_dump() == arch
    cfg = build_run_config({}, ["preset=cpu", "model.n_layer=3"])
    assert GPTConfig(**cfg.model.model_dump()).n_layer == 3


def test_custom_rules_use_the_presets_vocabulary():
    """A run's own rules may say `{fmt}` (the run's format) and `bf16` (high precision), exactly as
    the presets do: written out, no_head quantizes the same layers in the same formats."""
    from altgrad.quant.convert import quantized_layers
    from altgrad.run_model import build_model

    def formats(precision):
        cfg = build_run_config({"quant": {"format": "e3m4", "precision": precision}}, ["preset=cpu"])
        return {name: layer.policy.weight.name for name, layer in quantized_layers(build_model(cfg)).items()}

    written_out = formats([{"pattern": "lm_head", "format": "bf16"}, {"pattern": "*", "format": "{fmt}"}])
    assert written_out == formats("no_head") and "lm_head" not in written_out
    assert set(written_out.values()) == {"e3m4"} and len(written_out) == 4 * 2  # 4 linears x 2 layers
    with pytest.raises(ConfigError, match="unknown format 'e4m4'"):
        build_run_config({"quant": {"precision": [{"pattern": "*", "format": "e4m4"}]}}, ["preset=cpu"])
    with pytest.raises(ConfigError, match="grad_output off"):
        build_run_config({}, ["preset=cpu", "quant.grad_format=bf16"])
