"""An experiment directory read without Ray (`altgrad.experiment`): `load_experiment`'s records, cut
at the sweep's stops, and whether a driver on another host is alive."""

from __future__ import annotations

import json
import math
import time

import pytest
import yaml
from experiment_files import KEYS

from altgrad.experiment import SWEEP_FILE, driver_alive, load_experiment
from altgrad.tune.heartbeat import DriverHeartbeat
from altgrad.tune.store import StateStore


def test_load_experiment(experiment):
    records = load_experiment(experiment)
    assert [r.key for r in records] == KEYS
    assert [r.status for r in records] == ["TERMINATED", "TERMINATED", "TERMINATED", "RUNNING", "ERROR", "PENDING"]
    assert [r.stop_reason for r in records] == ["completed", "asha", "nan", None, "error", None]
    cut = records[1]
    assert cut.stop_step == 10 and cut.history[-1]["step"] == 10  # cut at the decision, not at 12
    assert cut.summary["steps"] == 10 and cut.summary["stop_reason"] == "asha"
    assert cut.summary["best_val_loss"] == pytest.approx(5.6)
    nan = records[2]
    assert nan.summary["best_val_loss"] == pytest.approx(6.0) and nan.summary["final_val_loss"] == math.inf
    assert records[4].error == "RuntimeError: boom"


def test_a_trial_carries_the_settings_its_format_set_on_top_of_the_base(experiment):
    """`grid.format_overrides` (the sweep's config) reaches each of its format's records as dotted
    paths, what the report says a cell of that format ran with; other formats carry none, and so
    does an experiment whose sweep file has no config."""
    sweep_file = experiment / "sweep_state" / SWEEP_FILE
    sweep = json.loads(sweep_file.read_text())
    assert all(r.overrides == {} for r in load_experiment(experiment))
    overrides = {"e4m3": {"optim": {"lr": 3.0}, "train": {}}, "e7m0": {"quant": {"master_weights": "format",
                                                                                  "grad_scaling": {"mode": "none"}}}}
    sweep_file.write_text(json.dumps({**sweep, "config": {"grid": {"format_overrides": overrides}}}))
    by_format = {r.format: r.overrides for r in load_experiment(experiment)}
    assert by_format["e4m3"] == {"optim.lr": 3.0}  # an empty section sets nothing
    assert by_format["e7m0"] == {"quant.master_weights": "format", "quant.grad_scaling.mode": "none"}
    assert all(o == {} for f, o in by_format.items() if f not in overrides)


def test_what_a_trial_computed_in_comes_from_its_summary_else_its_config(experiment):
    """`autocast` (what the report calls its bf16 baseline's compute): the summary's when it says,
    else the config's device and setting (a run from before summaries said it)."""
    def autocast_with(summary: dict | None, train: dict | None) -> bool | None:
        run = experiment / "trials" / KEYS[0] / "run"
        summary_file, config = run / "summary.json", run / "config.yaml"
        if summary is not None:
            summary_file.write_text(json.dumps({**json.loads(summary_file.read_text()), **summary}))
        if train is not None:
            config.write_text(yaml.safe_dump({"train": train}))
        return load_experiment(experiment)[0].autocast

    assert autocast_with(None, {"device": "cpu", "autocast": True}) is False
    assert autocast_with(None, {"device": "cuda", "autocast": False}) is False
    assert autocast_with(None, {"device": "cuda", "autocast": True}) is True
    assert autocast_with(None, {"device": "auto", "autocast": True}) is None
    assert autocast_with({"autocast": True}, None) is True


def test_whether_a_trial_stored_its_weights_in_their_format_comes_from_its_config(experiment):
    """What the failure analysis reads bit-stall by: weights stored in their format (quant.master_weights
    format, a quantized format), not fp32 masters, and never bf16's."""
    config = experiment / "trials" / KEYS[0] / "run" / "config.yaml"
    for quant, stored in (({"format": "e4m3", "master_weights": "format"}, True),
                          ({"format": "e4m3", "master_weights": "fp32"}, False), ({"format": "bf16"}, False)):
        config.write_text(yaml.safe_dump({"quant": quant}))
        assert load_experiment(experiment)[0].stored_in_format is stored


def test_a_driver_on_another_host_is_alive_while_its_heartbeat_is_fresh(tmp_path):
    """A sweep whose head node was lost can be resumed from a new head once the beat is stale."""
    store = StateStore(str(tmp_path))
    store.write(SWEEP_FILE, {"status": "running",
                             "driver": {"pid": 1, "host": "lost-head", "beat": time.time() - 3600}})
    assert not driver_alive(store.read(SWEEP_FILE)["driver"])
    DriverHeartbeat(store).on_step(0, [])
    assert driver_alive(store.read(SWEEP_FILE)["driver"])
