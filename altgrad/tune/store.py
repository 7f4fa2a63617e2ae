"""The sweep's own state files in `<experiment>/sweep_state/`, on local disk or on `s3://…`.

Written by the driver (scheduler, stopper, trial index) and read by the trial table. Local files are
replaced atomically (write a temp file, rename), so a reader or a `kill -9` never sees half a file;
object stores replace whole objects anyway.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from altgrad.config import utf8_text
from altgrad.experiment import STATE_DIR
from altgrad.remote import filesystem, is_remote, join


class StateStore:
    """JSON documents under `<experiment_path>/sweep_state/` (picklable: Ray pickles its holders).
    `patient` (a running sweep's): remote storage retries as long as pyarrow does; not patient (a
    look before the sweep starts), it fails within seconds (`remote.filesystem`)."""

    patient = True  # a class default too: a store pickled before it had one (tuner.pkl) is patient

    def __init__(self, experiment_path: str, patient: bool = True):
        self.experiment_path = experiment_path
        self.patient = patient

    def _path(self, name: str) -> str:
        return join(self.experiment_path, STATE_DIR, name)

    def read(self, name: str) -> Any:
        """The document, or None if it was never written."""
        if not is_remote(self.experiment_path):
            path = Path(self._path(name))
            return json.loads(utf8_text(path)) if path.is_file() else None
        fs, path = filesystem(self._path(name), self.patient)
        from pyarrow.fs import FileType

        if fs.get_file_info(path).type == FileType.NotFound:
            return None
        with fs.open_input_stream(path) as f:
            return json.loads(f.read().decode())

    def write(self, name: str, document: Any) -> None:
        text = json.dumps(document, indent=1, sort_keys=False)
        if is_remote(self.experiment_path):
            fs, path = filesystem(self._path(name), self.patient)
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            with fs.open_output_stream(path) as f:
                f.write(text.encode())
            return
        path = Path(self._path(name))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

