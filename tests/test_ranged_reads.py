"""Reading parts of a weights file, verified (``hasten.files.ranged``), in one process.

Files written by ``save_model`` with 4 KiB checksummed blocks (``ranged.BLOCK_SIZE``, the writer's
documented knob) and by ``safetensors.torch.save_file``; each test reads two rows of ``x`` the way a
process of a sharded load reads its block, after damaging the file in one place.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hasten.files import ranged
from hasten.files.errors import CheckpointCorruptError
from hasten.files.weights import CHECKSUM_KEY, UNSET_CHECKSUM, read_weights
from hasten.saving import save_model
from hasten.weights_sources import checkpoint_sources

ROWS = (slice(2, 4), slice(0, 256))  # 2 KiB of x's 16 KiB: its first 4 KiB block only


def _tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(16, 256, generator=g), "y": torch.randn(64, 64, generator=g),
            "b": torch.randn(5, generator=g).to(torch.bfloat16)}


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(ranged, "BLOCK_SIZE", 4096)


def _saved(folder, seed: int = 0) -> str:
    save_model(_tensors(seed), str(folder))
    return os.path.join(str(folder), "model.safetensors")


def _header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


def _flip(path: str, at: int, bit: int = 0x04) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ bit]))


def _at(path: str, key: str, byte: int) -> int:
    """The file position of byte ``byte`` of tensor ``key``."""
    start, header = _header(path)
    return start + header[key]["data_offsets"][0] + byte


def _read_rows(path: str) -> tuple[torch.Tensor, int]:
    part = ranged.RangedWeights(path)
    try:
        return part.blocks([("x", ROWS)])[0].clone(), part.bytes_read
    finally:
        part.close()


def test_save_model_file_records_block_and_header_checksums_and_reads_in_parts(tmp_path, small_blocks):
    path = _saved(tmp_path)
    metadata = _header(path)[1]["__metadata__"]
    assert metadata[ranged.BLOCK_SIZE_KEY] == "4096"
    assert metadata[ranged.HEADER_CHECKSUM_KEY].startswith("bsum64:")
    assert read_weights(path).recorded == metadata[CHECKSUM_KEY]  # the whole-file checksum still holds
    rows, read = _read_rows(path)
    assert torch.equal(rows, load_file(path)["x"][ROWS])
    assert read < os.path.getsize(path) // 3, read  # the header and one 4 KiB block


def test_plain_file_reads_only_the_rows(tmp_path):
    path = str(tmp_path / "plain.safetensors")
    save_file(_tensors(), path)
    rows, read = _read_rows(path)
    assert torch.equal(rows, _tensors()["x"][ROWS])
    assert read == _header(path)[0] + 2 * 256 * 4


def test_bit_flip_in_a_block_read_raises_naming_the_file_and_block(tmp_path, small_blocks):
    path = _saved(tmp_path)
    _flip(path, _at(path, "x", 3 * 1024 + 7))  # row 3
    with pytest.raises(CheckpointCorruptError, match="block 0 .*checksum") as e:
        _read_rows(path)
    assert path in str(e.value)


def test_bit_flip_in_a_block_not_read_is_not_read(tmp_path, small_blocks):
    path = _saved(tmp_path)
    _flip(path, _at(path, "y", 100))
    rows, _ = _read_rows(path)  # this reader never reads y: nothing to verify, nothing raised
    assert torch.equal(rows, _tensors()["x"][ROWS])
    with pytest.raises(CheckpointCorruptError):  # the flip is real: a reader of the whole file sees it
        read_weights(path)


@pytest.mark.parametrize("where", ["format", "shape", "block checksums", "header checksum", "checksum name"])
def test_bit_flip_in_the_header_raises(tmp_path, small_blocks, where):
    path = _saved(tmp_path)
    with open(path, "rb") as f:
        head = f.read(_header(path)[0])
    metadata = _header(path)[1]["__metadata__"]
    needle = {"format": b'"pt"', "shape": b'"shape":[16,256]',
              "block checksums": metadata[ranged.BLOCK_CHECKSUMS_KEY].encode()[:8],
              "header checksum": metadata[ranged.HEADER_CHECKSUM_KEY].encode(),
              "checksum name": b'"hasten_checksum"'}[where]
    _flip(path, head.index(needle) + len(needle) - 2, 0x01)
    with pytest.raises(CheckpointCorruptError) as e:
        _read_rows(path)
    assert path in str(e.value)


def test_truncated_file_raises(tmp_path, small_blocks):
    path = _saved(tmp_path)
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CheckpointCorruptError, match="outside the file"):
        _read_rows(path)


def test_file_truncated_after_its_header_was_read_raises(tmp_path):
    path = str(tmp_path / "plain.safetensors")
    save_file(_tensors(), path)
    part = ranged.RangedWeights(path)
    os.truncate(path, _header(path)[0] + 100)
    with pytest.raises(CheckpointCorruptError, match="ended .* early") as e:
        part.blocks([("x", ROWS)])
    assert path in str(e.value)
    part.close()


@pytest.mark.parametrize("writer", ["save_model", "save_file"])
def test_file_swapped_after_its_header_was_read_gives_the_first_files_bytes(tmp_path, small_blocks, writer):
    """The path replaced by another valid file (other values) between the header and the ranges: the
    ranges come from the file opened, never from the new one."""
    path, other = str(tmp_path / "a" / "model.safetensors"), str(tmp_path / "b" / "model.safetensors")
    for target, seed in ((path, 0), (other, 1)):
        if writer == "save_model":
            _saved(os.path.dirname(target), seed)
        else:
            os.makedirs(os.path.dirname(target))
            save_file(_tensors(seed), target)
    sources, _ = checkpoint_sources(os.path.dirname(path), release=True, ranged=True)
    os.replace(other, path)
    try:
        rows = sources[0].blocks([("x", ROWS)])[0]
    finally:
        sources[0].release()
    assert torch.equal(rows, _tensors(0)["x"][ROWS])


def test_file_with_a_whole_checksum_only_is_read_whole_and_verified(tmp_path):
    """An older hasten file (no block checksums): a sharded load reads it whole, verified by its checksum."""
    from hasten.files.reading import file_checksum

    folder = tmp_path / "old"
    folder.mkdir()
    path = str(folder / "model.safetensors")
    save_file(_tensors(), path, metadata={"format": "pt", CHECKSUM_KEY: UNSET_CHECKSUM})
    digest = file_checksum(path)
    with open(path, "r+b") as f:
        f.seek(f.read(_header(path)[0]).index(UNSET_CHECKSUM.encode()))
        f.write(digest.encode())
    assert read_weights(path).recorded == digest
    part = ranged.RangedWeights(path)
    assert part.whole_only
    part.close()
    sources, _ = checkpoint_sources(str(folder), release=True, ranged=True)
    assert sources[0].ranged is None
    assert torch.equal(sources[0].blocks([("x", ROWS)])[0], _tensors()["x"][ROWS])
    _flip(path, _at(path, "y", 100))  # outside the rows: still found, the whole file is verified
    with pytest.raises(CheckpointCorruptError, match="corrupted"):
        sources, _ = checkpoint_sources(str(folder), release=True, ranged=True)
        sources[0].blocks([("x", ROWS)])
