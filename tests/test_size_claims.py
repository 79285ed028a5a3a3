"""Sizes a checkpoint file states are bounded by the file's real size before anything is allocated.

Each crafted file is read in a forked child of one subprocess (torch imported once), which reports the
error and how much its peak resident memory grew: a reader that believes a claim allocates it."""

import io
import json
import os
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

# Runs in the subprocess: argv[1] is a JSON list of [reader, path]; prints one JSON result per case.
_RUNNER = r"""
import json, os, resource, sys, time
import torch
from hasten.checkpointing import deepspeed_state
from hasten.files import unpickling
from hasten.files.reading import read_path
from hasten.files.safetensors_format import SafetensorsView
from hasten.utils import offload

def read(reader, path):
    if reader == "dcp":
        unpickling.dcp_metadata(path)
    elif reader == "deepspeed":
        deepspeed_state._read(path)
    elif reader == "safetensors":
        SafetensorsView(read_path(path))
    elif reader == "dcp value":  # a DCP checkpoint folder whose byte item is the crafted pickle
        import io
        from hasten.checkpointing import dcp_reader
        dcp_reader.load_folder({"extra": io.BytesIO()}, path)
    elif reader == "accelerate bin":
        from hasten.checkpointing import accelerate_folder
        accelerate_folder._torch_load(path)
    elif reader == "model bin":
        from hasten.utils.modeling import load_state_dict
        load_state_dict(path)
    elif reader == "offload":
        folder, name = os.path.split(path)
        index = json.load(open(os.path.join(folder, "index.json")))
        offload.load_offloaded_weight(path, index[name[:-4]])

results = []
for reader, path in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.monotonic()
        try:
            read(reader, path)
            outcome = {"error": None, "message": ""}
        except BaseException as e:
            outcome = {"error": type(e).__name__, "message": str(e)}
        outcome["seconds"] = time.monotonic() - start
        outcome["grew_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        os.write(w, json.dumps(outcome).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    results.append(json.loads(data) if data else {"error": "child died", "message": "", "seconds": 0, "grew_mib": 0})
print(json.dumps(results))
"""


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def _torch_zip(data_pkl: bytes, records: dict = None) -> bytes:
    """A zip archive laid out as torch.save writes one (stored records under one prefix)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        for name, value in (records or {}).items():
            archive.writestr(f"archive/{name}", value)
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


def _saved(obj, **kwargs) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)
    return buffer.getvalue()


def _claim_record(archive: bytes, size: int) -> bytes:
    """``archive`` with its data.pkl claiming ``size`` bytes in the central directory."""
    entry = archive.index(b"PK\x01\x02")
    while not archive[entry + 46:].split(b"PK", 1)[0].endswith(b"data.pkl") and b"data.pkl" not in archive[entry + 46:entry + 46 + 64]:
        entry = archive.index(b"PK\x01\x02", entry + 4)
    return archive[:entry + 20] + struct.pack("<II", size, size) + archive[entry + 28:]


def _cases(tmp) -> dict:
    """name -> (reader, file bytes, words the error must hold)."""
    legacy = _saved({"a": torch.zeros(4)}, _use_new_zipfile_serialization=False)
    at = legacy.index(b"X\x03\x00\x00\x00cpu") + 8 + 1  # the memo op after "cpu", then numel K\x04
    at = legacy.index(b"K\x04", at)
    legacy_claim = legacy[:at] + _int(1 << 30) + legacy[at + 2:]
    zipped = _saved({"a": torch.zeros(4)})
    with zipfile.ZipFile(io.BytesIO(zipped)) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        pkl = archive.read(name)
    view_claim = pkl.replace(b"K\x04\x85", _int(1 << 28) + b"\x85", 1)  # the tensor's size (4,) -> (2**28,)
    assert view_claim != pkl
    storage = zipped[zipped.index(b"\x00" * 16):][:16]  # four float zeros, the record data/0
    header = json.dumps({"t": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 16]}}).encode()
    return {
        # 30 bytes: bytearray(2**30)
        "dcp bytearray": ("dcp", b"\x80\x02" + _global("builtins", "bytearray") + _int(1 << 30) + b"\x85R.",
                          ["bytearray(1073741824)", "30 bytes"]),
        # 9 bytes: memo entry 2**26 (the C unpickler grows its memo to twice the index: 1 GiB)
        "dcp memo index": ("dcp", b"\x80\x02Nr" + struct.pack("<I", 1 << 26) + b".", ["memo entry at index 67108864"]),
        # torch.Tensor(2**15, 2**15): an uninitialized 4 GiB tensor from a few bytes
        "deepspeed tensor constructor": ("deepspeed", _torch_zip(
            b"\x80\x02}X\x01\x00\x00\x00a" + _global("torch", "Tensor") + _int(1 << 15) + _int(1 << 15) + b"\x86Rs."),
            ["uninitialized tensor of shape (32768, 32768)"]),
        # torch's legacy format: a storage of 2**30 floats is allocated before its bytes are read
        "deepspeed legacy storage": ("deepspeed", legacy_claim, ["storage of 1073741824 elements"]),
        # a tensor of 2**28 floats viewing a 16-byte storage (torch's set_ grows resizable storages)
        "deepspeed tensor view": ("deepspeed", _torch_zip(view_claim, {"data/0": storage}),
                                  ["shape (268435456,)", "storage of 16 bytes"]),
        # a zip record whose directory entry claims 1 GiB (torch's reader allocates a record's size to read it)
        "deepspeed zip record size": ("deepspeed", _claim_record(zipped, 1 << 30), ["claims 1073741824 bytes"]),
        # audited, already bounded: a safetensors header length and a shape beyond the file
        "safetensors header length": ("safetensors", struct.pack("<Q", 1 << 40) + b"{}", ["header length"]),
        "safetensors shape": ("safetensors", struct.pack("<Q", len(header)) + header + bytes(16),
                              ["16 data bytes for shape"]),
    }


def _replace_value(folder, fqn: str, data: bytes) -> None:
    """Point the DCP checkpoint's byte item ``fqn`` at ``data``, appended to its shard file."""
    import dataclasses
    import pickle

    metadata = pickle.loads((folder / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(data)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(data))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _run(cases: dict, tmp) -> dict:
    files = []
    for i, (name, (reader, data, _)) in enumerate(cases.items()):
        path = tmp / f"case{i}" / ("mp_rank_00_model_states.pt" if reader == "deepspeed" else ".metadata")
        path.parent.mkdir()
        path.write_bytes(data)
        files.append([reader, str(path)])
    # torch's own weights-only unpickler calls bytearray(2**30) as a 30-byte pickle asks
    bomb = b"\x80\x02" + _global("builtins", "bytearray") + _int(1 << 30) + b"\x85R."
    import torch.distributed.checkpoint as dcp

    folder = tmp / "dcp_value"
    dcp.save({"extra": 7}, checkpoint_id=str(folder), no_dist=True)
    _replace_value(folder, "extra", bomb)
    files.append(["dcp value", str(tmp / "dcp_value")])
    (tmp / "optimizer.bin").write_bytes(bomb)
    files.append(["accelerate bin", str(tmp / "optimizer.bin")])
    (tmp / "pytorch_model.bin").write_bytes(bomb)
    files.append(["model bin", str(tmp / "pytorch_model.bin")])
    offload_dir = tmp / "offload"
    offload_dir.mkdir()
    (offload_dir / "w.dat").write_bytes(bytes(16))
    (offload_dir / "index.json").write_text(json.dumps({"w": {"dtype": "float32", "shape": [1 << 30, 1 << 30]}}))
    files.append(["offload", str(offload_dir / "w.dat")])
    env = dict(os.environ, PYTHONPATH=os.environ.get("HASTEN_TEST_SRC", SRC))
    done = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(files)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    names = [*cases, "dcp value bytearray", "accelerate bin bytearray", "model bin bytearray", "offload shape"]
    return {name: (files[i][1], results[i]) for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("claims")
    cases = _cases(tmp)
    return cases, _run(cases, tmp)


_WORDS = {"offload shape": ["needs", "bytes"],
          # the value's shard file is named, and the claim with the bytes the value holds
          "dcp value bytearray": ["__0_0.distcp", "'extra'", "bytearray(1073741824)", "30 bytes"],
          "accelerate bin bytearray": ["bytearray(1073741824)", "30 bytes"],
          "model bin bytearray": ["bytearray(1073741824)", "30 bytes"]}


@pytest.mark.parametrize("name", ["dcp bytearray", "dcp memo index", "deepspeed tensor constructor",
                                  "deepspeed legacy storage", "deepspeed tensor view",
                                  "deepspeed zip record size", "safetensors header length",
                                  "safetensors shape", "dcp value bytearray", "accelerate bin bytearray",
                                  "model bin bytearray", "offload shape"])
def test_a_claimed_size_is_bounded_by_the_file(outcomes, name):
    cases, results = outcomes
    path, result = results[name]
    words = cases[name][2] if name in cases else _WORDS[name]
    message = result["message"]
    assert result["grew_mib"] < 64, f"{name}: peak memory grew by {result['grew_mib']:.0f} MiB ({message})"
    assert result["error"] is not None, f"{name}: the crafted file was read without an error"
    assert repr(path) in message or path in message, f"{name}: the error does not name the file: {message}"
    for word in words:
        assert word in message, f"{name}: {word!r} missing from: {message}"
    assert result["seconds"] < 5, f"{name}: took {result['seconds']:.1f} s"
