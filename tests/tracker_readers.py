"""Read a run back from each experiment tracker with the tool's own reader, for the tracking tests.

MLflow: its client (`MlflowClient`) against the tracking server. TensorBoard: its `EventAccumulator`.
W&B offline: the run's `.wandb` files, W&B's transaction log (LevelDB's log format, each record one of
W&B's own `Record` protobufs, `wandb.proto.wandb_internal_pb2`): what `wandb sync` uploads.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK, _HEADER = 32 * 1024, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_log_records(path: Path):
    """Each record of one `.wandb` file, as W&B's `Record` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic, version)
    offset, pending = 7, b""
    while offset + _HEADER <= len(data):
        room = _BLOCK - offset % _BLOCK
        if room < _HEADER:  # the rest of a block too small for a header is padding
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + _HEADER])
        payload = data[offset + _HEADER:offset + _HEADER + length]
        offset += _HEADER + length
        if kind == 0 and length == 0:
            offset += room - _HEADER
            continue
        if kind == _FULL:
            pending = payload
        elif kind == _FIRST:
            pending = payload
            continue
        elif kind == _MIDDLE:
            pending += payload
            continue
        elif kind == _LAST:
            pending += payload
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        yield record


def wandb_offline_run(wandb_dir: Path, run_id: str) -> dict:
    """Every offline session of one run (a folder each), joined as `wandb sync` joins them: history rows
    by step, config, summary, tags, and the files saved."""
    history: list[dict] = []
    config: dict = {}
    summary: dict = {}
    tags: set[str] = set()
    files: set[str] = set()
    sessions = sorted(Path(wandb_dir).glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    for log in sessions:
        for record in wandb_log_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                history.append(row)
            elif kind == "config":
                for item in record.config.update:
                    config[item.key] = json.loads(item.value_json)
            elif kind == "summary":
                for item in record.summary.update:
                    summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            elif kind == "run":
                tags.update(record.run.tags)
            elif kind == "files":
                files.update(Path(f.path).name for f in record.files.files)
    return {"sessions": len(sessions), "history": history, "config": config, "summary": summary, "tags": tags,
            "files": files}


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Each scalar's (step, value) list as TensorBoard shows it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_texts(log_dir: Path) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    texts: dict[str, list[str]] = {}
    for tag in events.Tags()["tensors"]:
        for event in events.Tensors(tag):
            value = tensor_util.make_ndarray(event.tensor_proto)
            texts.setdefault(tag.removesuffix("/text_summary"), []).append(
                value.item().decode() if value.shape == () else value.ravel()[0].decode())
    return texts
