"""W&B's offline runs read back, for the W&B sink's tests (tests/test_sink_wandb*.py).

``WANDB_MODE=offline`` writes each run as ``<WANDB_DIR>/wandb/offline-run-<time>-<id>/``
with its transaction log ``run-<id>.wandb``: every record the run made (the run itself,
history rows, summary updates, alerts, files), the log ``wandb sync`` uploads later. W&B
0.31 ships no Python reader for it (``wandb.sdk.internal.datastore`` is gone; the Go
service reads it), so it is read here: the file is LevelDB's log format with W&B's header
(``:W&B``, magic ``0xBEE1``, version 0), 32 KiB blocks of chunks, each chunk with a CRC-32
of its type byte and payload, and each whole record a ``wandb_internal_pb2.Record``. Every
chunk's checksum is verified, so a reader that went wrong fails loudly instead of
returning a plausible nothing; the records are W&B's own protobuf messages, parsed by
W&B's own classes.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7  # checksum (4), length (2), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = 7, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        payload = data[pos + _HEADER:pos + _HEADER + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, \
            f"{path}: bad checksum at byte {pos}"
        pos += _HEADER + length
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            yield pending + payload


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


@dataclass
class OfflineRun:
    """One offline run directory, its records sorted by kind."""

    path: Path
    run: Any = None  # the RunRecord (the first one)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    alerts: list[Any] = field(default_factory=list)  # AlertRecords: title, text, level
    config: dict[str, Any] = field(default_factory=dict)
    preempting: int = 0
    exit_code: int | None = None
    kinds: list[str] = field(default_factory=list)

    def series(self, key: str) -> list[tuple[Any, Any]]:
        """``(eventbus/step, value)`` of each history row that has ``key``."""
        return [(row.get("eventbus/step"), row[key]) for row in self.history if key in row]

    def tables(self, key: str) -> list[dict[str, Any]]:
        """The tables logged under ``key``, last first, read from the run's files."""
        folder = self.path / "files" / "media" / "table" / key.rsplit("/", 1)[0]
        name = key.rsplit("/", 1)[-1]
        # <name>_<history step>_<hash>.table.json: the later step, the later table
        paths = [p for p in folder.glob(f"{name}_*.table.json")
                 if p.name[len(name) + 1:].split("_", 1)[0].isdigit()]
        paths.sort(key=lambda p: int(p.name[len(name) + 1:].split("_", 1)[0]), reverse=True)
        return [json.loads(p.read_text()) for p in paths]


def read_offline_run(path: Path) -> OfflineRun:
    """The records of the offline run in the directory ``path``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = path.glob("run-*.wandb")
    out = OfflineRun(path)
    for payload in _payloads(log):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        out.kinds.append(str(kind))
        if kind == "run" and out.run is None:
            out.run = record.run
        elif kind == "history":
            out.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                out.summary[_key(item)] = json.loads(item.value_json)
        elif kind == "alert":
            out.alerts.append(record.alert)
        elif kind == "config":
            for item in record.config.update:
                out.config[_key(item)] = json.loads(item.value_json)
        elif kind == "preempting":
            out.preempting += 1
        elif kind == "exit":
            out.exit_code = record.exit.exit_code
    return out


def offline_runs(wandb_dir: Path) -> list[OfflineRun]:
    """Every offline run under ``WANDB_DIR`` (``<dir>/wandb/offline-run-*``), oldest first."""
    return [read_offline_run(p) for p in sorted((wandb_dir / "wandb").glob("offline-run-*"))]
