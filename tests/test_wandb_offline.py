"""An offline wandb run read back through wandb's own record format, as `wandb sync` would upload it.

`read_offline_run` decodes a run's `run-<id>.wandb` transaction log: the file is LevelDB-log framed (a 7-byte
":W&B" header, 32 KiB blocks of CRC-checked chunks, the same framing `wandb sync` reads), and each record is
wandb's own protobuf `wandb.proto.wandb_internal_pb2.Record`. History rows come back as {step: {key: value}};
a logged table is a `table-file` entry whose JSON lies under the run's `files/`, loaded here as wandb wrote it.

The trainer's real run is read in tests/test_trainer_e2e.py (`test_wandb_offline_run_reads_back`, on the run it
already makes); here `recipe.tracking.Tracking` writes a small run with known values, which must read back exactly.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

_HEADER = struct.Struct("<4sHB")  # ident ":W&B", magic 0xBEE1, version 0
_CHUNK = struct.Struct("<IHB")  # crc32 of (type byte + data), data length, type
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    """What an offline run recorded: history rows by step, its config, and its directory."""

    directory: Path
    history: dict[int, dict[str, Any]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    def keys(self) -> set[str]:
        return set().union(*self.history.values()) if self.history else set()

    def table(self, key: str, step: int) -> dict[str, Any]:
        """The wandb table logged under `key` at `step`, as wandb wrote it ({"columns": [...], "data": [...]})."""
        ref = self.history[step][key]
        assert ref["_type"] == "table-file", ref
        return json.loads((self.directory / "files" / ref["path"]).read_text())


def _payloads(data: bytes) -> list[bytes]:
    """The records' bytes from LevelDB-log framing, every chunk's CRC checked."""
    ident, magic, version = _HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a wandb transaction log"
    out, pending, pos = [], b"", _HEADER.size
    while pos + _CHUNK.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK.size:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # the zero-filled rest of the last block
            break
        chunk = data[pos + _CHUNK.size: pos + _CHUNK.size + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"corrupt chunk at byte {pos}"
        pos += _CHUNK.size + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
    return out


def read_offline_run(run_dir: str | Path) -> OfflineRun:
    """Read `<wandb dir>/offline-run-*/` (its one `run-<id>.wandb` file) with wandb's Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir = Path(run_dir)
    (log,) = run_dir.glob("run-*.wandb")
    run = OfflineRun(run_dir)
    for payload in _payloads(log.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            _update(run.history.setdefault(record.history.step.num, {}), record.history.item)
        elif kind in ("run", "config"):  # the run record carries the initial config, config records later updates
            _update(run.config, record.run.config.update if kind == "run" else record.config.update)
    return run


def _update(target: dict[str, Any], items) -> None:
    """Items with a `key`, or a `nested_key` path (a logged dict, e.g. a table's reference), into `target`."""
    for item in items:
        *parents, last = list(item.nested_key) or [item.key]
        node = target
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = json.loads(item.value_json)


@pytest.mark.unit
def test_tracking_run_reads_back_exactly(tmp_path, monkeypatch):
    """Contract: what `Tracking` sends to wandb offline (metrics per step, a table, the config) is in the run's
    transaction log under the same keys, steps and values, and the table's columns and rows load back; the log is
    long enough (> 2 blocks of 32 KiB) that records split across blocks are joined back."""
    from recipe.tracking import Tracking

    monkeypatch.setenv("WANDB_MODE", "offline")
    tracker = Tracking(["wandb"], "polyturn-test", "readback", tmp_path, config={"trainer": {"seed": 3}})
    tracker.log({"actor/pg_loss": 0.5, "timing/step_s": 1.25}, 1)
    tracker.log_table("val/generations", ["uid", "score"], [["a", 1.0], ["b", 0.0]], 1)
    tracker.log({"val-core/gsm8k/reward/mean@1": 0.25, "actor/pg_loss": -0.125}, 2)
    filler = {f"rollout/tool/tool_{i}/calls": float(i) for i in range(80)}
    for step in range(3, 23):
        tracker.log({**filler, "timing/step_s": step / 8}, step)
    tracker.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert next(run_dir.glob("run-*.wandb")).stat().st_size > 2 * 32 * 1024
    run = read_offline_run(run_dir)
    assert sorted(run.history) == list(range(1, 23))
    assert all(run.history[k] == {**run.history[k], **filler, "timing/step_s": k / 8} for k in range(3, 23))
    assert run.history[1]["actor/pg_loss"] == 0.5 and run.history[1]["timing/step_s"] == 1.25
    assert run.history[2]["val-core/gsm8k/reward/mean@1"] == 0.25 and run.history[2]["actor/pg_loss"] == -0.125
    table = run.table("val/generations", 1)
    assert table["columns"] == ["uid", "score"] and table["data"] == [["a", 1.0], ["b", 0.0]]
    assert run.config["trainer"] == {"seed": 3}
