"""What verifying ``save_model`` outputs costs ``load_checkpoint_in_model``.

    python bench/save_model_load.py                  # ~300 MB fp32 model, 15 interleaved rounds
    python bench/save_model_load.py --mb 500 --rounds 25 --dir /path/on/the/disk/to/test

``save_model`` writes the weights once (the file records its own bsum64, which
``load_checkpoint_in_model`` recomputes while it reads, before the model changes). Two copies are made
of that file, byte for byte, written the same way: "verified" as it is, and "unverified" with the
checksum field overwritten by a field of the same length that is not a checksum, so the loader can
only check the header, as for a file another library wrote. Only the verification differs between
them: same size, same tensors at the same offsets, same write path (so the same layout on the disk).
Each round loads both into the same live model (copy into the existing parameters), in alternating
order, from the page cache (each file read once, untimed, before) and, where ``posix_fadvise``
exists, after evicting the files from the page cache (reading from the disk). Medians and the
verified / unverified ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

from hasten.model_loading import load_checkpoint_in_model
from hasten.saving import save_model
from hasten.weights_sources import verify_weights_file


def _model(mb: int) -> nn.Module:
    layers = max(1, round(mb * 1e6 / (2048 * 2048 * 4)))
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(layers)])


def _evict(folder: str) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _warm(folder: str) -> None:
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(64 << 20):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = _model(args.mb)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        folders = {"verified": os.path.join(root, "verified"), "unverified": os.path.join(root, "unverified")}
        save_model(model.state_dict(), os.path.join(root, "saved"))
        with open(os.path.join(root, "saved", "model.safetensors"), "rb") as f:
            data = f.read()
        field = re.search(rb'"hasten_checksum"\s*:\s*"bsum64:[0-9a-f]{8}"', data[:1 << 20])
        assert field is not None, "save_model wrote no checksum field"
        blank = b'"unverified_____":"' + b"_" * (field.end() - field.start() - 20) + b'"'
        assert len(blank) == field.end() - field.start()
        copies = {"verified": data, "unverified": data[:field.start()] + blank + data[field.end():]}
        for kind, content in copies.items():
            os.makedirs(folders[kind])
            with open(os.path.join(folders[kind], "model.safetensors"), "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
        del data, copies
        recorded = {kind: verify_weights_file(os.path.join(folders[kind], "model.safetensors")) for kind in folders}
        assert recorded["verified"] is not None and recorded["unverified"] is None, recorded
        size = os.path.getsize(os.path.join(folders["verified"], "model.safetensors"))
        target = _model(args.mb)
        for kind in folders:  # untimed: the process's first large allocations and the threads' start
            load_checkpoint_in_model(target, folders[kind])
        times: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for cache in ("page cache", "disk"):
                order = ("verified", "unverified") if r % 2 else ("unverified", "verified")
                for kind in order:
                    if cache == "disk" and not _evict(folders[kind]):
                        continue
                    if cache == "page cache":
                        _warm(folders[kind])
                    start = time.perf_counter()
                    load_checkpoint_in_model(target, folders[kind])
                    times.setdefault(f"{kind}, {cache}", []).append(time.perf_counter() - start)
        print(f"load_checkpoint_in_model of {size / 1e6:.0f} MB, {args.rounds} rounds (median s, MB/s):")
        for key, values in times.items():
            median = statistics.median(values)
            print(f"  {key:<24} {median:.3f} s  {size / 1e6 / median:7.0f} MB/s   min {min(values):.3f} s   all: "
                  + " ".join(f"{v:.3f}" for v in values))
        for cache in ("page cache", "disk"):
            if f"verified, {cache}" in times:
                ratio = statistics.median(times[f"verified, {cache}"]) / statistics.median(times[f"unverified, {cache}"])
                best = min(times[f"verified, {cache}"]) / min(times[f"unverified, {cache}"])
                print(f"  verified / unverified ({cache}): {ratio:.2f}x of medians, {best:.2f}x of minima")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
