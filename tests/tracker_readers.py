"""Read back what a tracker wrote, with each tracker's own reader (for the tracking tests)."""

from __future__ import annotations

import glob
import json
import os
import struct
import time


def tensorboard_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the event files directly in ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_texts(logdir: str) -> dict[str, list[tuple[int, str]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        out[tag] = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in acc.Tensors(tag)]
    return out


def tensorboard_images(logdir: str) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"images": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Images(tag)] for tag in acc.Tags()["images"]}


def tensorboard_hparams(logdir: str) -> dict[str, object]:
    """The hyperparameters of the HParams plugin, from the sub-folder add_hparams wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    found: dict[str, object] = {}
    for sub in [logdir, *sorted(glob.glob(os.path.join(logdir, "*", "")))]:
        acc = EventAccumulator(sub)
        acc.Reload()
        try:
            contents = acc.PluginTagToContent("hparams").values()
        except KeyError:  # this folder holds no hyperparameters
            continue
        for content in contents:
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if data.HasField("session_start_info"):
                for key, value in data.session_start_info.hparams.items():
                    kind = value.WhichOneof("kind")
                    found[key] = getattr(value, kind)
    return found


def mlflow_runs(tracking_uri: str, experiment: str) -> list[dict]:
    """Every run of ``experiment``: its status, params and metric histories [(step, value)]."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = []
    for run in client.search_runs([exp.experiment_id]):
        metrics = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                   for key in run.data.metrics}
        runs.append({"status": run.info.status, "params": dict(run.data.params), "metrics": metrics})
    return runs


def wandb_offline_runs(wandb_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb")))


def wandb_records(path: str) -> list:
    """The records of a ``.wandb`` transaction log (LevelDB log framing, wandb's protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_finished_records(path: str, timeout: float = 60.0) -> list:
    """The records once the run's exit record is in the file.

    wandb's service writes the log in the background: ``run.finish()`` can return (on a loaded
    machine) before the file holds everything, so wait for the last record to arrive.
    """
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_history(path: str) -> dict[str, list[tuple[int, object]]]:
    """key -> [(step, value)] of the logged history (wandb's own "_" keys left out)."""
    out: dict[str, list] = {}
    for record in wandb_finished_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                out.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return out


def wandb_config(path: str) -> dict[str, object]:
    config: dict[str, object] = {}
    for record in wandb_finished_records(path):
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in items:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                config[key] = json.loads(item.value_json)["value"] if "value" in item.value_json else json.loads(item.value_json)
    return config


def wandb_exited(path: str) -> bool:
    return any(r.WhichOneof("record_type") == "exit" for r in wandb_finished_records(path))
