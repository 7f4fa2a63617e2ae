"""The trainable's side of a sweep (`altgrad.tune.trainable`) without Ray running: the signals it
reports (rebuilt exactly on resume) and which reports carry checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from altgrad.config import StabilityConfig
from altgrad.metrics import STABLE_LR, STALL_STREAK
from altgrad.tune.trainable import SweepSignals, TuneReporter


def rows(n: int, stall: list[float]) -> list[dict[str, float]]:
    return [{"step": float(s), "train/loss": 5.0 - s / 10, "val/loss": 5.0 - (s // 5) / 2,
             "val/step": float(s // 5 * 5 or 1), "quant/bit_stall_rate": stall[s - 1]}
            for s in range(1, n + 1)]


def test_signals_after_resume_equal_an_unbroken_run(monkeypatch):
    """The stall streak and first val loss are rebuilt from the run's history on resume."""
    from altgrad.tune import trainable

    reported: list[dict] = []
    monkeypatch.setattr(trainable.tune, "report", lambda m, checkpoint=None: reported.append(m))
    history = rows(12, [0.999] * 3 + [0.5] + [0.999] * 8)
    unbroken = TuneReporter(SweepSignals(StabilityConfig(), 1e-3), [], attach_checkpoints=False)
    for row in history:
        unbroken(row, None)
    expected = reported[:]
    reported.clear()
    resumed = TuneReporter(SweepSignals(StabilityConfig(), 1e-3), history[:9], attach_checkpoints=False)  # as the kill left it
    for row in history[6:]:  # resumed from the checkpoint at step 6
        resumed(row, None)
    assert reported == expected[5:]  # the checkpoint's own row again first (its report may be lost)
    assert expected[-1][STALL_STREAK] == 8.0
    assert expected[-1][STABLE_LR] == 1e-3



def test_a_trial_resumed_at_its_end_reports_its_last_row_once(monkeypatch):
    """Killed after its last step but before Tune recorded its end, a trial restarts, trains no
    step, and must still give the scheduler a result with its metrics."""
    from altgrad.tune import trainable

    reported: list[dict] = []
    monkeypatch.setattr(trainable.tune, "report", lambda m, checkpoint=None: reported.append(m))
    history = rows(12, [0.999] * 12)
    unbroken = TuneReporter(SweepSignals(StabilityConfig(), 1e-3), [], attach_checkpoints=False)
    for row in history:
        unbroken(row, None)
    resumed = TuneReporter(SweepSignals(StabilityConfig(), 1e-3), history, attach_checkpoints=False)
    resumed.report_if_silent()
    resumed.report_if_silent()  # once only
    assert reported[12:] == [reported[11]]
    trained = TuneReporter(SweepSignals(StabilityConfig(), 1e-3), history[:6], attach_checkpoints=False)
    trained(history[6], None)
    trained.report_if_silent()  # it reported: nothing more
    assert reported[13:] == [reported[5], reported[6]]  # the checkpoint's row, then its own


@pytest.mark.parametrize("attach", [True, False], ids=["remote", "local"])
def test_checkpoints_go_to_tune_only_on_remote_storage(monkeypatch, tmp_path, attach):
    """On local storage the run dir is the durable copy; a Tune checkpoint there could be rotated
    away before Tune saves its experiment state, and a restore from that state would then fail."""
    from altgrad.tune import trainable

    sent: list = []
    monkeypatch.setattr(trainable.tune, "report", lambda m, checkpoint=None: sent.append(checkpoint))
    reporter = TuneReporter(SweepSignals(StabilityConfig(), 1e-3), [], attach_checkpoints=attach)
    (tmp_path / "step_000005").mkdir()
    for row, ckpt in zip(rows(6, [0.5] * 6), [None] * 4 + [tmp_path / "step_000005", None], strict=True):
        reporter(row, ckpt)
    assert [c is not None for c in sent] == [False] * 4 + [attach, False]
    if attach:
        assert sent[4].path == str(tmp_path / "step_000005")


def test_signals_report_inf_for_a_non_finite_evaluation_and_no_stable_rate_for_a_nan_step():
    s = SweepSignals(StabilityConfig(), 1e-2)
    ok = s.observe({"step": 1.0, "val/loss": 5.0, "val/step": 1.0})
    assert ok["val/loss"] == 5.0 and ok[STABLE_LR] == 0.0  # not below its first evaluation yet
    nan = s.observe({"step": 2.0, "val/loss": 5.0, "val/step": 1.0, "stability/loss_is_nan": 1.0})
    assert nan["val/loss"] == 5.0 and nan[STABLE_LR] == 0.0  # a skipped step: the evaluation stands
    learning = s.observe({"step": 3.0, "val/loss": 4.0, "val/step": 3.0})
    assert learning[STABLE_LR] == 1e-2
    assert s.observe({"step": 4.0, "val/loss": math.nan, "val/step": 4.0})["val/loss"] == math.inf


def test_a_run_dir_whose_checkpoint_never_arrived_resumes_from_tunes(monkeypatch, tmp_path):
    """A run dir fetched from the bucket of a machine killed mid-upload holds its newest
    checkpoint's directory but not its file: the trial resumes from Tune's checkpoint of that step,
    not into an error nor from an older one. Without Tune's, from an older whole one, and with none
    it starts over. With its file, the run dir (newer after a driver kill) comes first."""
    from ray import tune

    from altgrad.train.checkpoint import save_checkpoint
    from altgrad.tune import trainable

    tune_checkpoint = save_checkpoint(tmp_path / "tune" / "checkpoint_000001", {"step": 10, "model": {}})
    monkeypatch.setattr(trainable.tune, "get_checkpoint",
                        lambda: tune.Checkpoint.from_directory(str(tune_checkpoint)))
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000010").mkdir(parents=True)  # its file never arrived
    with trainable.resume_point(run_dir) as resume:
        assert Path(resume) == tune_checkpoint
    save_checkpoint(run_dir / "checkpoints" / "step_00000005", {"step": 5, "model": {}})  # an older one, whole
    with trainable.resume_point(run_dir) as resume:
        assert Path(resume) == tune_checkpoint

    monkeypatch.setattr(trainable.tune, "get_checkpoint", lambda: None)  # the driver died before recording it
    with trainable.resume_point(run_dir) as resume:
        assert resume == run_dir
    (run_dir / "checkpoints" / "step_00000005" / "checkpoint.pt").unlink()  # nothing whole: start over
    with trainable.resume_point(run_dir) as resume:
        assert resume is None
    with trainable.resume_point(tmp_path / "fresh") as resume:
        assert resume is None

    save_checkpoint(run_dir / "checkpoints" / "step_00000015", {"step": 15, "model": {}})  # a driver kill
    monkeypatch.setattr(trainable.tune, "get_checkpoint",
                        lambda: tune.Checkpoint.from_directory(str(tune_checkpoint)))
    with trainable.resume_point(run_dir) as resume:
        assert resume == run_dir


def test_a_run_dir_is_fetched_whole_or_not_at_all(monkeypatch, s3_bucket, tmp_path):
    """A retry on a node whose earlier attempt died mid-fetch finds no run dir (so it fetches
    again), not the part that had arrived; the fetch then brings every file, and nothing of the
    killed attempt's."""
    from pyarrow.fs import FileSelector, FileSystem, LocalFileSystem, copy_files

    from altgrad.train.checkpoint import save_checkpoint
    from altgrad.tune import trainable

    run = tmp_path / "uploaded"
    save_checkpoint(run / "checkpoints" / "step_00000005", {"step": 5, "model": {}})
    (run / "metrics.jsonl").write_text('{"step": 5}\n')
    bucket, prefix = FileSystem.from_uri(f"{s3_bucket}/fetch-test/trial")
    copy_files(str(run), f"{prefix}/run", source_filesystem=LocalFileSystem(), destination_filesystem=bucket)
    sent = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())
    assert sent == sorted(i.path.split("/run/", 1)[1]
                          for i in bucket.get_file_info(FileSelector(f"{prefix}/run", recursive=True))
                          if i.type.name == "File")

    def dies_midway(source, destination, **kwargs):  # the metrics arrive, the checkpoint does not
        copy_files(source, destination, **kwargs)
        next(Path(destination).rglob("checkpoint.pt")).unlink()
        raise OSError("node lost")

    node = tmp_path / "node"
    monkeypatch.setattr(trainable, "copy_files", dies_midway)
    with pytest.raises(OSError):
        trainable.fetch_run_dir(bucket, f"{prefix}/run", node / "run")
    assert not (node / "run").exists()

    monkeypatch.setattr(trainable, "copy_files", copy_files)
    trainable.fetch_run_dir(bucket, f"{prefix}/run", node / "run")
    assert sorted(p.relative_to(node / "run").as_posix() for p in (node / "run").rglob("*") if p.is_file()) == sent
    assert all((node / "run" / f).read_bytes() == (run / f).read_bytes() for f in sent)
    assert [p.name for p in node.iterdir()] == ["run"]

    trainable.fetch_run_dir(bucket, f"{prefix}/none", node / "elsewhere")  # no run dir in the bucket yet
    assert not (node / "elsewhere").exists()


@pytest.mark.parametrize("ending, logged", [(SystemExit(0), "trial stopped by Tune"),
                                            (SystemExit(None), "trial stopped by Tune"),
                                            (SystemExit(3), "trial failed"),
                                            (RuntimeError("boom"), "trial failed")])
def test_trial_log_tells_a_stop_from_a_failure(tmp_path, ending, logged):
    """Tune stops a trial (ASHA, the stopper) by SystemExit(0) inside `report`: its trial.log says it
    was stopped, with no traceback; it said "ERROR trial failed" and ended in `SystemExit: 0`."""
    from altgrad.tune.trainable import trial_log

    path = tmp_path / "trial.log"
    with pytest.raises(type(ending)), trial_log(path):
        raise ending
    text = path.read_text()
    assert logged in text
    assert ("Traceback" in text) == (logged == "trial failed")
