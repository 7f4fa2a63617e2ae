"""The trainer's stability monitor (`altgrad.train.stability`) end to end: a run that survives and
one that collapses, each checked against events.jsonl and metrics.jsonl."""

from __future__ import annotations

import json
import math

import pytest

from altgrad.experiment import read_jsonl
from altgrad.train import Trainer

pytestmark = pytest.mark.usefixtures("eager_kernels")


@pytest.mark.parametrize(("extra", "expected"), [
    ((), ("completed", 8, None, None)),  # e7m0 + manifold at the cpu preset survives 8 steps
    (("optim.lr=1e30",), ("nan", 3, 2, "forward")),  # embeddings overflow: the loss is NaN at once
], ids=["default", "forced_collapse"])
def test_e7m0_runs_to_its_end_or_records_why_it_stopped(make_config, tmp_path, extra, expected):
    """Both outcomes, each checked against events.jsonl and metrics.jsonl."""
    cfg = make_config("quant.format=e7m0", "quant.master_weights=format", "optim.name=manifold",
                      "train.max_steps=8", "train.shadow_every=0", "train.diag_every=0",
                      "train.eval_interval=100", "stability.nan_patience=2", *extra)
    summary = Trainer(cfg, tmp_path).fit()
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (summary["stop_reason"], summary["steps"], summary["collapse_step"], summary["collapse_where"]) == expected

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [int(r["step"]) for r in rows] == list(range(1, summary["steps"] + 1))
    bad = [int(r["step"]) for r in rows if r["stability/loss_is_nan"] or r["stability/grad_has_nan"]]
    events = read_jsonl(tmp_path / "events.jsonl")
    skips = [e for e in events if e["kind"] == "nan_skip"]
    assert [e["step"] for e in skips] == bad
    stops = [e["step"] for e in events if e["kind"] == "nan_stop"]
    if summary["stop_reason"] == "nan":
        assert bad[0] == summary["collapse_step"] and skips[0]["where"] == summary["collapse_where"]
        assert bad == list(range(summary["collapse_step"], summary["steps"] + 1))  # the fatal streak
        assert stops == [summary["steps"]] and not math.isfinite(rows[-1]["train/loss"])
        assert (tmp_path / f"checkpoints/anomaly_step_{summary['collapse_step']:08d}").is_dir()
    else:
        assert bad == [] and stops == [] and all(math.isfinite(r["train/loss"]) for r in rows)
