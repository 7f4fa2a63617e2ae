"""`python -m altgrad trials` (`altgrad.tune.trials`): exit 2 for what is not an experiment, cannot be
read, or holds a corrupt trial (still listing the others), and no torch or Ray loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from experiment_files import KEYS

from altgrad.__main__ import main
from altgrad.experiment import (
    RUN_DIR,
    STATE_DIR,
    TRIALS_DIR,
    TRIALS_FILE,
    ExperimentError,
    load_experiment,
)


def test_not_an_experiment(tmp_path, capsys):
    with pytest.raises(ExperimentError, match="not an AltGrad experiment"):
        load_experiment(tmp_path)
    assert main(["trials", str(tmp_path / "nope")]) == 2
    assert "not an AltGrad experiment (does not exist)" in capsys.readouterr().err


def test_a_corrupt_trial_is_listed_and_exits_2(experiment, capsys):
    metrics = experiment / TRIALS_DIR / KEYS[0] / RUN_DIR / "metrics.jsonl"
    metrics.write_text("{broken\n" + metrics.read_text())
    assert main(["trials", str(experiment), "--json"]) == 2
    out, err = capsys.readouterr()
    rows = {r["trial"]: r for r in json.loads(out)}
    assert len(rows) == 6 and rows[KEYS[0]]["error"].startswith("unreadable: ")
    assert rows[KEYS[1]]["stop_reason"] == "asha"
    assert KEYS[0] in err


def test_an_s3_prefix_that_is_no_experiment_is_named_as_given(s3_bucket, capsys):
    """Not by the local folder it was fetched into, which the user never named."""
    uri = f"{s3_bucket}/nothing/here"
    assert main(["trials", uri]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {uri} is not an AltGrad experiment") and "altgrad-fetch-" not in err


def test_a_corrupt_trial_on_s3_names_its_file_in_the_bucket(experiment, s3_bucket, capsys):
    """Not the temp copy it was read from, which is gone by the time the user reads the message."""
    from altgrad.remote import upload_dir

    (experiment / TRIALS_DIR / KEYS[0] / RUN_DIR / "summary.json").write_text("{broken")
    metrics = experiment / TRIALS_DIR / KEYS[1] / RUN_DIR / "metrics.jsonl"
    metrics.write_text("{broken\n" + metrics.read_text())
    uri = f"{s3_bucket}/corrupt/exp"
    upload_dir(experiment, uri)
    assert main(["trials", uri, "--json"]) == 2
    errors = {r["trial"]: r["error"] for r in json.loads(capsys.readouterr().out)}
    assert errors[KEYS[0]].startswith(f"unreadable: {uri}/{TRIALS_DIR}/{KEYS[0]}/{RUN_DIR}/summary.json: not valid JSON")
    assert errors[KEYS[1]] == f"unreadable: {uri}/{TRIALS_DIR}/{KEYS[1]}/{RUN_DIR}/metrics.jsonl: line 1 is not valid JSON"
    (experiment / STATE_DIR / TRIALS_FILE).write_text("{not json")
    upload_dir(experiment, uri)
    assert main(["trials", uri]) == 2
    assert f"{uri}/{STATE_DIR}/{TRIALS_FILE}: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("base, parts, joined", [
    ("s3://b/exps?endpoint_override=http://h:9000&scheme=http", ("spot", "sweep_state"),
     "s3://b/exps/spot/sweep_state?endpoint_override=http://h:9000&scheme=http"),
    ("s3://b/exps/", ("spot",), "s3://b/exps/spot"),
    ("/data/odd?name", ("spot",), "/data/odd?name/spot"),  # a local folder's "?" is its name's
])
def test_paths_join_before_a_uris_query(base, parts, joined):
    from altgrad.remote import join, split_name

    assert join(base, *parts) == joined
    assert split_name(joined) == (join(base, *parts[:-1]), parts[-1])


def test_an_experiment_named_with_its_endpoint_in_the_query_is_read_and_reported_beside(
        experiment, s3_bucket, capsys, monkeypatch):
    """`s3://bucket/prefix?endpoint_override=…`, Ray's documented way to name an S3-compatible
    server (no AWS_ENDPOINT_URL here): paths go before the query, as in `trials`' fetch, the
    report written beside the experiment, and a corrupt file named by its place in the bucket."""
    from pyarrow.fs import FileSelector

    from altgrad.remote import filesystem, join, upload_dir

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    uri = f"{s3_bucket}/query/exp/?endpoint_override={endpoint}"  # (a trailing "/" too)
    upload_dir(experiment, uri)
    fs, root = filesystem(uri)
    assert root == "altgrad-sweeps/query/exp" and fs.get_file_info(f"{root}/{STATE_DIR}/{TRIALS_FILE}").size > 0
    assert main(["trials", uri, "--json"]) == 0
    assert {r["trial"] for r in json.loads(capsys.readouterr().out)} >= set(KEYS)
    assert main(["report", uri]) == 0
    assert capsys.readouterr().out.strip() == f"report written: {join(uri, 'report', 'report.md')}"
    assert "report.md" in {f.base_name for f in fs.get_file_info(FileSelector(f"{root}/report"))}
    (experiment / TRIALS_DIR / KEYS[0] / RUN_DIR / "summary.json").write_text("{broken")
    upload_dir(experiment, uri)
    assert main(["trials", uri, "--json"]) == 2
    errors = {r["trial"]: r["error"] for r in json.loads(capsys.readouterr().out)}
    assert errors[KEYS[0]].startswith(
        f"unreadable: {s3_bucket}/query/exp/{TRIALS_DIR}/{KEYS[0]}/{RUN_DIR}/summary.json: not valid JSON")


def test_a_report_written_to_s3_is_in_the_bucket(experiment, s3_bucket, capsys):
    """`report --out s3://…` uploads the report: the option was read as a local path ("s3:/…"),
    and the report went to a local folder named "s3:"."""
    from pyarrow.fs import FileSelector

    from altgrad.remote import filesystem

    out = f"{s3_bucket}/reports/one"
    assert main(["report", str(experiment), "--out", out]) == 0
    assert capsys.readouterr().out.strip() == f"report written: {out}/report.md"
    fs, root = filesystem(out)
    assert "report.md" in {f.base_name for f in fs.get_file_info(FileSelector(root))}
    assert not list(Path.cwd().glob("s3:"))


def test_a_sweep_on_s3_ends_with_its_trial_table(experiment, s3_bucket, capsys):
    """Read from the bucket as `trials` reads it, not a request to copy it to local disk first."""
    from sweep_helpers import ABLATION

    from altgrad.remote import upload_dir
    from altgrad.tune.ablation import FormatAblation
    from altgrad.tune.config import SweepConfig, load_sweep_config

    cfg = load_sweep_config(SweepConfig, ABLATION, ["preset=cpu"], storage_path=f"{s3_bucket}/table")
    upload_dir(experiment, cfg.experiment_path)
    assert FormatAblation.summarize(cfg, []) == 0
    out = capsys.readouterr().out
    assert all(key in out for key in KEYS) and "local disk" not in out


@pytest.mark.parametrize("uri", ["gs://altgrad-unreachable/exp", "hdfs://altgrad-unreachable:1/exp",
                                 "abfs://sweeps@altgradunreachable.dfs.core.windows.net/exp"])
def test_storage_that_cannot_be_reached_is_one_line_within_seconds(uri):
    """Without network or credentials (the tests have neither) every pyarrow scheme fails as S3 does:
    GCS retried for 15 minutes, HDFS's reason ran on for dozens of lines of libjvm paths, and
    Azure's bare ArrowException was a traceback."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "altgrad", "trials", uri], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and time.monotonic() - start < 30
    assert proc.stderr.splitlines()[-1].startswith(f"error: cannot read {uri}: ") and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()[-1]) < 600  # GCS's status repeated itself in its error_info: ~1,000


def test_a_running_sweeps_state_on_gcs_keeps_pyarrows_retries(monkeypatch):
    """Readers give up on GCS within seconds; a running sweep's own state files (`StateStore`) keep
    pyarrow's retries, so a blip of a few seconds does not end a sweep of hours. (The retry limit is
    read off the filesystem pyarrow built: there is no network here to time it against.)"""
    import pickle

    import altgrad.tune.store as store
    from altgrad.remote import GCS_RETRY_S, filesystem
    from altgrad.tune.store import StateStore

    def retry_limit(fs) -> float | None:
        limit = fs.__reduce__()[1][0]["retry_time_limit"]
        return None if limit is None else limit.total_seconds()

    assert retry_limit(filesystem("gs://bucket/exp")[0]) == GCS_RETRY_S
    assert retry_limit(filesystem("gs://bucket/exp", patient=True)[0]) is None
    assert retry_limit(filesystem("gs://bucket/exp?retry_limit_seconds=60")[0]) == 60

    asked = []

    def unreachable(uri: str, patient: bool = False):
        asked.append(patient)
        raise OSError("unreachable")

    monkeypatch.setattr(store, "filesystem", unreachable)
    for patient in (True, False):
        with pytest.raises(OSError):
            StateStore("gs://bucket/exp", patient=patient).read("sweep.json")
    with pytest.raises(OSError):
        StateStore("gs://bucket/exp").write("sweep.json", {})
    assert asked == [True, False, True]
    old = StateStore("gs://bucket/exp")  # as the previous version pickled it (tuner.pkl): no field
    del old.patient
    assert pickle.loads(pickle.dumps(old)).patient


def test_a_report_that_cannot_be_written_to_its_storage_is_one_line(experiment, capsys):
    """`report --out` to storage that cannot be reached: one line, exit 2 (Azure's bare
    ArrowException was a traceback, HDFS's reason dozens of lines)."""
    for out in ("hdfs://altgrad-unreachable:1/report", "abfs://sweeps@altgradunreachable.dfs.core.windows.net/r"):
        assert main(["report", str(experiment), "--out", out]) == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert err.startswith(f"error: cannot write the report to {out}: ")
    assert not list(Path.cwd().glob("*:"))  # nor a local folder named "hdfs:" (--out read as a Path)


@pytest.mark.parametrize("command", ["trials", "report"])
def test_a_corrupt_sweep_file_exits_2_with_a_message(experiment, capsys, command):
    """Both readers open an experiment the same way (`read_experiment`): a sweep file that is not
    JSON is an error naming the experiment, never a traceback."""
    (experiment / STATE_DIR / TRIALS_FILE).write_text("{not json")
    assert main([command, str(experiment)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {experiment}: cannot read the experiment: ") and "Traceback" not in err


# `python -m altgrad trials EXP`, then the names of the top-level packages it loaded on stderr.
RUN_AS_MAIN = """
import runpy, sys
sys.argv = ["altgrad", "trials", sys.argv[1]]
try:
    runpy.run_module("altgrad", run_name="__main__", alter_sys=True)
finally:
    print("loaded:", *sorted({m.split(".")[0] for m in sys.modules}), file=sys.stderr)
"""


def test_trials_command_imports_neither_torch_nor_ray(experiment):
    """The table is read while a sweep runs: `python -m altgrad trials` must not load torch or Ray."""
    proc = subprocess.run([sys.executable, "-c", RUN_AS_MAIN, str(experiment)],
                          capture_output=True, text=True, timeout=60)
    assert "stop reason" in proc.stdout
    loaded = proc.stderr.rsplit("loaded:", 1)[1].split()
    assert "altgrad" in loaded
    assert "torch" not in loaded and "ray" not in loaded
