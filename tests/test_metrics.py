"""Which steps carry which metrics (`altgrad.metrics`): the one rule the trainer writes by and the
sweep's stopper and estimate count by."""

from __future__ import annotations

from altgrad.config import build_run_config
from altgrad.metrics import is_diagnostic_step, is_eval_step, is_logged_step, is_shadow_step


def test_step_rules_at_the_cpu_preset():
    t = build_run_config({}, ["preset=cpu", "train.log_interval=4", "train.diag_every=3",
                              "train.shadow_every=0"]).train
    steps = range(1, t.max_steps + 1)
    assert (t.max_steps, t.eval_interval, t.checkpoint_interval) == (60, 20, 20)
    assert [s for s in steps if is_eval_step(t, s)] == [1, 20, 40, 60]
    assert [s for s in steps if is_diagnostic_step(t, s)][:4] == [1, 3, 6, 9]
    assert not any(is_shadow_step(t, s) for s in steps)  # 0: off, step 1 included
    logged = [s for s in steps if is_logged_step(t, s)]
    assert logged[:3] == [4, 8, 12] and 20 in logged and 60 in logged and 1 not in logged
