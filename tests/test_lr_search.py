"""The learning-rate search's result (`altgrad.tune.lr_search`): the largest stable learning rate per
format, from trial records alone."""

from __future__ import annotations


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


def test_a_search_on_s3_ends_with_the_command_that_reads_it(capsys):
    """`python -m altgrad trials` reads each format's experiment from the bucket: no copy to local disk."""
    from sweep_helpers import LR_SEARCH

    from altgrad.tune.config import LrSearchConfig, load_sweep_config
    from altgrad.tune.lr_search import LrSearch

    cfg = load_sweep_config(LrSearchConfig, LR_SEARCH, ["preset=cpu"], storage_path="s3://bucket/p")
    assert LrSearch.summarize(cfg, []) == 0
    out = capsys.readouterr().out
    assert f"python -m altgrad trials s3://bucket/p/{cfg.name}/<format> (formats: {', '.join(cfg.formats)})" in out
    assert "local disk" not in out
