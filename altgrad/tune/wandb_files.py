"""Reads W&B's local run files: the `run-<id>.wandb` transaction log in each `offline-run-*` (or
online `run-*`) folder, a LevelDB-style log of protobuf `Record`s (a 7-byte header ':W&B' + magic
+ version, then 32 KiB blocks of chunks, each [crc32, length, type] + payload).

W&B's service writes this log in large buffered chunks: a process killed with SIGKILL can leave
none of its rows on disk. What a run really holds is therefore read here, not assumed
(`wandb_runs.TrialRun` resumes after the last step these files hold).
"""

from __future__ import annotations

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

HEADER = 7
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[pb.Record]:
    """The complete records of one transaction log; a torn tail (the writer was killed) is dropped."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    out, chunks, pos = [], [], HEADER
    while pos + CHUNK_HEADER <= len(data):
        block_left = BLOCK - pos % BLOCK
        if block_left < CHUNK_HEADER:  # a block's tail too small for a chunk header is padding
            pos += block_left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        end = pos + CHUNK_HEADER + length
        if (length == 0 and kind == 0) or end > len(data):
            break
        chunks.append(data[pos + CHUNK_HEADER:end])
        pos = end
        if kind in (FULL, LAST):
            record = pb.Record()
            try:
                record.ParseFromString(b"".join(chunks))
            except Exception:  # noqa: BLE001 - protobuf's DecodeError: a torn record ends the log
                break
            out.append(record)
            chunks = []
    return out


def run_logs(directory: Path, run_id: str | None = None) -> dict[str, list[list[pb.Record]]]:
    """run id -> the records of each local run folder under `directory` with that id, oldest
    first (every attempt at a run writes its own folder)."""
    runs: dict[str, list[list[pb.Record]]] = {}
    for log in sorted(directory.rglob(f"run-{run_id or '*'}.wandb"), key=lambda p: p.parent.name):
        runs.setdefault(log.stem.removeprefix("run-"), []).append(records(log))
    return runs


def history_steps(attempts: list[list[pb.Record]]) -> list[int]:
    """The step of every history row, in the order the attempts logged them."""
    return [r.history.step.num for recs in attempts for r in recs if r.HasField("history")]


def last_logged_step(directory: Path, run_id: str) -> int:
    """The last step of the run `run_id` that its files under `directory` hold (0: none)."""
    return max(history_steps(run_logs(directory, run_id).get(run_id, [])), default=0)
