"""Reads W&B's offline run files: the `run-<id>.wandb` transaction log of each `offline-run-*`
folder, a LevelDB-style log of protobuf `Record`s (7-byte header ':W&B' + magic + version, then
32 KiB blocks of [crc32, length, type] + payload chunks)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

HEADER = 7
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[pb.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, chunks, pos = [], [], HEADER
    while pos + 7 <= len(data):
        block_left = BLOCK - (pos % BLOCK) if pos >= BLOCK else BLOCK - pos
        if block_left < 7:  # a block's tail too small for a chunk header is padding
            pos += block_left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            out.append(record)
            chunks = []
    return out


def offline_runs(directory: Path) -> dict[str, list[list[pb.Record]]]:
    """run id -> the records of each offline run folder with that id, oldest first."""
    runs: dict[str, list[list[pb.Record]]] = {}
    for folder in sorted(directory.rglob("offline-run-*")):
        (log,) = folder.glob("run-*.wandb")
        runs.setdefault(log.stem.removeprefix("run-"), []).append(records(log))
    return runs


def history_steps(attempts: list[list[pb.Record]]) -> list[int]:
    return [r.history.step.num for recs in attempts for r in recs if r.HasField("history")]


def history_rows(attempts: list[list[pb.Record]]) -> dict[int, dict[str, float]]:
    """step -> the logged values (numbers) of that step."""
    return {r.history.step.num: {"/".join(i.nested_key) or i.key: float(json.loads(i.value_json))
                                 for i in r.history.item if _number(i.value_json)}
            for recs in attempts for r in recs if r.HasField("history")}


def _number(value_json: str) -> bool:
    return value_json in ("NaN", "Infinity", "-Infinity") or isinstance(json.loads(value_json), int | float)


def alerts(attempts: list[list[pb.Record]]) -> list[pb.AlertRecord]:
    return [r.alert for recs in attempts for r in recs if r.HasField("alert")]
