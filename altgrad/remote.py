"""Experiments on object storage (`s3://bucket/prefix/<name>`, or any URI pyarrow opens): readers
fetch the files they read into a local directory and read that.

A sweep on `s3://` keeps everything in the bucket, so a researcher reads it from any machine
without `aws s3 sync`. Only what the trial table and the report read is fetched: the sweep's state
and each run directory's small files, never checkpoints or Ray's files. Credentials and endpoint
come from the usual AWS variables (`AWS_ENDPOINT_URL` for an S3-compatible server), or the
endpoint from the URI's query (`?endpoint_override=…`, as Ray documents it), as for the sweep
itself.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from altgrad.experiment import (
    CONFIG_FILE,
    EVENTS_FILE,
    METRICS_FILE,
    RUN_DIR,
    STATE_DIR,
    SUMMARY_FILE,
)

READ_FILES = (METRICS_FILE, EVENTS_FILE, SUMMARY_FILE, CONFIG_FILE)  # of a run directory

# How long a GCS request retries before it fails. pyarrow's default is 15 minutes, so a reader
# without network (or a typo in a bucket it may not see) hung instead of saying why; S3's default
# strategy gives up within about a second. A few seconds still ride out a transient 503.
GCS_RETRY_S = 3


def is_remote(path: str | Path) -> bool:
    """Whether `path` names object storage (a URI such as `s3://bucket/prefix`), not a local path."""
    return "://" in str(path)


def join(base: str, *parts: str) -> str:
    """`base/part/...`. On object storage the parts go before the URI's query, which stays: Ray
    documents `s3://bucket/prefix?endpoint_override=http://host:9000` as the way to name an
    S3-compatible server, and pyarrow reads the query as the filesystem's options."""
    path, sep, query = str(base).partition("?") if is_remote(base) else (str(base), "", "")
    return "/".join([path.rstrip("/"), *parts]) + sep + query


def split_name(base: str) -> tuple[str, str]:
    """(parent, last part) of a path or URI (`join`'s inverse); a URI's query stays with the parent."""
    path, sep, query = str(base).partition("?") if is_remote(base) else (str(base), "", "")
    parent, name = path.rstrip("/").rsplit("/", 1)
    return parent + sep + query, name


def without_query(uri: str) -> str:
    """A URI as a message names a place in it: its query holds the filesystem's options (an
    endpoint, a retry limit), not part of the path."""
    return str(uri).partition("?")[0] if is_remote(uri) else str(uri)


def filesystem(uri: str, patient: bool = False):
    """(pyarrow filesystem, path inside it) of a URI. On GCS its retries are bounded
    (`GCS_RETRY_S`) unless the URI sets `retry_limit_seconds` itself, or the caller is `patient`:
    a running sweep's own state (`StateStore`), which rides out an outage with pyarrow's retries
    rather than ending a sweep of hours on a blip of seconds."""
    from pyarrow.fs import FileSystem

    scheme = uri.split("://", 1)[0]
    if scheme in ("gs", "gcs") and not patient and "retry_limit_seconds=" not in uri:
        uri = f"{uri}{'&' if '?' in uri else '?'}retry_limit_seconds={GCS_RETRY_S}"
    return FileSystem.from_uri(join(uri))  # (a trailing "/" dropped, before the query too)


def storage_errors() -> tuple[type[Exception], ...]:
    """What a pyarrow filesystem raises when its storage cannot be reached or read: OSError, and
    the bare ArrowException some raise (Azure's, when it finds no credentials)."""
    from pyarrow import ArrowException

    return OSError, ArrowException


def cannot(what: str, error: Exception) -> str:
    """`cannot <what>: <why>`, on one line: pyarrow's reasons can run to dozens of lines (HDFS lists
    every libjvm it looked for), and GCS's status ends in an `error_info={...}` that repeats the
    message in its metadata (~1,000 characters in all)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    reason, cut, _ = lines[0].partition(" error_info={")
    return f"cannot {what}: {reason}{')' if cut and reason.count('(') > reason.count(')') else ''}"


def _read(relative: str) -> bool:
    """Whether a reader needs the experiment file at this relative path."""
    parts = relative.split("/")
    return parts[0] == STATE_DIR or (len(parts) >= 2 and parts[-2] == RUN_DIR and parts[-1] in READ_FILES)


def fetch_experiment(uri: str, destination: Path) -> Path:
    """Copy the files readers need of the experiment at `uri` under `destination`; returns
    `destination / <name>`, which `load_experiment` reads like a local experiment."""
    from pyarrow.fs import FileSelector, FileType

    fs, root = filesystem(uri)
    local = destination / root.rsplit("/", 1)[-1]
    if fs.get_file_info(root).type != FileType.Directory:
        local.mkdir(parents=True, exist_ok=True)  # empty: load_experiment says what is missing
        return local
    for info in fs.get_file_info(FileSelector(root, recursive=True)):
        relative = info.path[len(root):].lstrip("/")
        if info.type != FileType.File or not _read(relative):
            continue
        target = local / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(info.path) as f:
            target.write_bytes(f.read())
    return local


@contextmanager
def readable(experiment: str | Path) -> Iterator[Path]:
    """A local directory to read the experiment from: itself, or a fetched copy of a remote one."""
    if not is_remote(experiment):
        yield Path(experiment)
        return
    with tempfile.TemporaryDirectory(prefix="altgrad-fetch-") as tmp:
        yield fetch_experiment(str(experiment), Path(tmp))


def upload_dir(local: Path, uri: str) -> None:
    """Copy a local directory's files to `uri` (a report written next to a remote experiment)."""
    fs, root = filesystem(uri)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        target = f"{root}/{path.relative_to(local).as_posix()}"
        fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(target) as f:
            f.write(path.read_bytes())
