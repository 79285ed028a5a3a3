"""Rank-side checks for test_attack_paths.py: an FSDP2 save_state folder over 2 processes whose DCP
files are tampered with (the manifest updated as an editor would), then load_state on every rank."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil

import torch
from torch import nn


def _tamper_manifest(folder: str, name: str) -> None:
    path = os.path.join(folder, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    from hasten.checkpointing import layout
    from hasten.files import reading as filereading

    full = os.path.join(folder, name)
    manifest["files"][name].update(size=os.path.getsize(full), checksum=filereading.file_checksum(full))
    manifest[layout.CHECKSUM_KEY] = layout.manifest_checksum(manifest)  # as an editor of a checkpoint would
    with open(path, "w") as f:
        json.dump(manifest, f)


def _edit_metadata(folder: str, change) -> None:
    from hasten.files.unpickling import dcp_metadata

    path = os.path.join(folder, "sharded", ".metadata")
    metadata = dcp_metadata(path)
    change(metadata)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    _tamper_manifest(folder, "sharded/.metadata")


def _first_weight(metadata):
    return next(k for k in metadata.state_dict_metadata if k.startswith("model_0.") and k.endswith("weight"))


def _parent(metadata):
    fqn = _first_weight(metadata)
    for key, info in list(metadata.storage_data.items()):
        if key.fqn == fqn:
            metadata.storage_data[key] = dataclasses.replace(info, relative_path="../../outside.distcp")


def _huge(metadata):
    meta = metadata.state_dict_metadata[_first_weight(metadata)]
    meta.size = torch.Size([2 ** 20, 2 ** 20])


def _truncate(folder: str) -> None:
    path = os.path.join(folder, "sharded", "__1_0.distcp")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    _tamper_manifest(folder, "sharded/__1_0.distcp")


def _garble(folder: str) -> None:
    path = os.path.join(folder, "sharded", "__0_0.distcp")
    data = bytearray(open(path, "rb").read())
    data[:64] = bytes(64)
    open(path, "wb").write(data)
    _tamper_manifest(folder, "sharded/__0_0.distcp")


def check_fsdp2_dcp_attacks():
    import torch.distributed as dist

    from hasten import Accelerator
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin

    out = os.environ["HASTEN_TEST_TMP"]
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 6, device=acc.device)).pow(2).mean())
    opt.step()
    good = os.path.join(out, "good")
    acc.save_state(good)
    attacks = {"parent": lambda f: _edit_metadata(f, _parent), "huge": lambda f: _edit_metadata(f, _huge),
               "truncated": _truncate, "garbled": _garble}
    if acc.is_main_process:
        shutil.copy(os.path.join(good, "sharded", "__0_0.distcp"), os.path.join(out, "outside.distcp"))
        for label, attack in attacks.items():
            shutil.copytree(good, os.path.join(out, label))
            attack(os.path.join(out, label))
    dist.barrier()
    seen = {}
    for label in attacks:
        try:
            acc.load_state(os.path.join(out, label))
        except BaseException as e:  # noqa: BLE001 - a CheckpointException must not get here: judged by the test
            seen[label] = f"{type(e).__name__}: {e}".replace(out, "<tmp>")
        else:
            seen[label] = "loaded"
        dist.barrier()
    acc.load_state(good)  # the intact folder still loads
    return seen
