"""Reading DCP checkpoints without torch's ``pickle.load``: the storage reader and load planner that
``load_state`` and ``hasten merge-weights`` hand to ``torch.distributed.checkpoint.load``.

DCP's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with ``pickle.load`` and its
``DefaultLoadPlanner.load_bytes`` reads non-tensor values (optimizer hyperparameters) with
``torch.load(weights_only=False)``: either runs whatever code a replaced file names. Here the
metadata goes through ``unpickling.dcp_metadata`` (an allow-list of DCP's records) and the values
through ``weights_only.load_bytes`` (hasten's bounded allow-list unpickler).

``FileSystemReader.read_data`` also opens each ``.distcp`` again by path after hasten checked it: a
file replaced, linked elsewhere or rewritten in place in between would be loaded unverified. Here
``MetadataReader.read_data`` reads each shard file this process needs once through ``files.reading``
(opened without following links, a plain file inside the folder, its size and checksum checked
against the manifest's records in the same pass) and serves every item from those private bytes.
"""

from __future__ import annotations

import io
import math
import os
import stat
from typing import Any, Callable, Optional

import torch
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..files import unpickling
from ..files.errors import CheckpointCorruptError
from ..files.paths import is_link, open_inside, why_outside
from ..files.reading import ReadFile, read_inside

# Where the bytes of a shard file come from: ``open(name)`` gives them read and verified (a ``ReadFile``),
# ``release(name, read)`` lets them go once this process took what it needed from them.
Opener = Callable[[str], ReadFile]


def _file_size(folder: str, name: Any, what: str) -> int:
    """The size of the shard file ``name`` that ``.metadata`` names, refusing anything but a plain file
    directly inside ``folder``: an absolute path, ``..``, a separator, or a symbolic link would let a
    crafted ``.metadata`` read files outside the checkpoint."""
    why = why_outside(folder, name, nested=False)
    if why:
        raise CheckpointCorruptError(
            f"{what} names the shard file {name!r} in {folder!r}: {why}; DCP writes only plain names of real files "
            "inside the folder, so the metadata is damaged or crafted (nothing was read; copy real files in "
            "instead of linking them)")
    try:
        fd = open_inside(folder, name, "DCP shard file", nested=False)  # a plain file, no link
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{what} names the shard file {os.path.join(folder, name)!r}, which is missing; "
                                     "the checkpoint is incomplete or damaged") from None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def check_folder(folder: str) -> None:
    """Refuse a DCP folder that is a symbolic link, or whose ``.metadata`` is one."""
    for path in (folder, os.path.join(folder, ".metadata")):
        if is_link(path):
            raise CheckpointCorruptError(
                f"{path!r} is a symbolic link; hasten reads only plain files and folders inside a checkpoint "
                "(copy the real one in instead of linking it)")


def validate(folder: str, metadata: Metadata) -> None:
    """Check DCP ``metadata`` against the files of ``folder`` before anything is read or allocated.

    Every storage record must name a plain file inside ``folder`` and lie within its real size, and
    every tensor's claimed size must be covered by chunks whose stored bytes can hold them: a
    crafted ``.metadata`` could otherwise make a reader allocate terabytes (``torch.empty`` of the
    claimed size) or read outside the folder. Raises ``CheckpointCorruptError`` naming the file.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    what = repr(os.path.join(folder, ".metadata"))
    storage = getattr(metadata, "storage_data", None)
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(storage, dict) or not isinstance(entries, dict):
        raise CheckpointCorruptError(f"{what} has no storage records; the file is damaged")
    sizes: dict[str, int] = {}
    stored: dict[tuple, int] = {}  # (fqn, chunk offsets) -> bytes stored
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if name not in sizes:
            sizes[name] = _file_size(folder, name, what)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if (not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0
                or offset + length > sizes[name]):
            raise CheckpointCorruptError(
                f"{what} says {getattr(index, 'fqn', index)!r} is stored at bytes {offset}..+{length} of "
                f"{os.path.join(folder, str(name))!r}, which has {sizes[name]} bytes: the shard file was truncated or "
                "the metadata is damaged")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointCorruptError(
                f"{what} stores {getattr(index, 'fqn', index)!r} through the transforms {info.transform_descriptors}; "
                "hasten reads only plain (uncompressed) DCP shards")
        offsets = getattr(index, "offset", None)
        key = (getattr(index, "fqn", None), tuple(offsets) if offsets is not None else None)
        stored[key] = stored.get(key, 0) + length
    for fqn, meta in entries.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        _check_tensor(what, fqn, meta, stored)


def _check_tensor(what: str, fqn: str, meta: Any, stored: dict[tuple, int]) -> None:
    """A tensor's claimed size must be what its chunks cover, and each chunk's bytes must be stored."""
    def bad(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{what}: tensor {fqn!r} claims size {list(meta.size)}, but {why}; the metadata "
                                      "is damaged or crafted (nothing was allocated)")

    size = tuple(meta.size)
    if any(not isinstance(d, int) or d < 0 for d in size):
        raise bad("a size must be made of non-negative integers")
    dtype = getattr(meta.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise bad(f"its dtype {dtype!r} is not a torch dtype")
    itemsize = torch.empty((), dtype=dtype).element_size()
    covered = 0
    for chunk in meta.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise bad(f"its chunk at {list(offsets)} of size {list(sizes)} lies outside it")
        numel = math.prod(sizes)
        if numel == 0:  # an empty shard (a process holding no rows) needs no bytes
            continue
        have = stored.get((fqn, offsets))
        if have is None:
            raise bad(f"its chunk at {list(offsets)} has no storage record")
        if numel * itemsize > have:
            raise bad(f"its chunk at {list(offsets)} needs {numel * itemsize} bytes and only {have} are stored")
        covered += numel
    if covered != math.prod(size):
        raise bad(f"its chunks cover {covered} of its {math.prod(size)} elements")


def wrapped(folder: str, error: BaseException) -> CheckpointCorruptError:
    """DCP's ``CheckpointException`` (a ``BaseException`` carrying every rank's traceback) as one error
    naming the folder and the cause."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:  # DCP gathers these to every rank: each words it the same
        rank = min(failures)
        cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        marker = next((i for i, line in enumerate(lines) if "WeightsUnpickler error" in line), None)
        detail = lines[marker + 1] if marker is not None and marker + 1 < len(lines) else (lines[0] if lines else "")
        why = f"process {rank}: {type(cause).__name__}: {detail[:600]}"
    else:
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        why = lines[-1] if lines else type(error).__name__
    return CheckpointCorruptError(f"cannot read the DCP shards in {folder!r} ({why}); a shard file (*.distcp) there is "
                                  "damaged or incomplete")


def records_opener(folder: str, records: Optional[dict[str, Any]] = None, checksums: bool = True) -> Opener:
    """Read shard files of ``folder`` through ``files.reading``, checked against ``records`` (name inside the
    folder -> the manifest's ``{"size", "checksum"}``) where they hold the file."""
    records = records or {}

    def opener(name: str) -> ReadFile:
        info = records.get(name) or {}
        return read_inside(folder, name, info.get("size"), info.get("checksum") if checksums else None,
                           what="DCP shard file")
    return opener


class MetadataReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata is read with the allow-list, or handed in already read, and
    whose shard files are read once through ``files.reading`` (``read_data``), never again by path.

    ``opener``/``release``: where the verified bytes of a shard file come from and where they go after
    use (default: ``records_opener`` of the folder without records, i.e. its real size; closed after use).
    """

    def __init__(self, path: str, metadata: Optional[Metadata] = None, opener: Optional[Opener] = None,
                 release: Optional[Callable[[str, ReadFile], None]] = None) -> None:
        super().__init__(path)
        self.given = metadata
        self.opener = opener or records_opener(os.fspath(path))
        self.release = release or (lambda name, read: read.close())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self.given is not None:
            metadata, self.given = self.given, None  # used once: a reset reader reads the file again
        else:  # the global file, or a rank-local one (DCP's fallback when the global one is missing)
            metadata = unpickling.dcp_metadata(os.path.join(self.path, ".metadata" if rank is None
                                                            else f"__{rank}.metadata"))
        validate(os.fspath(self.path), metadata)  # DCP reads the files these records name
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Future:
        """Every item of ``plan`` from the verified private bytes of its shard file, one file at a time
        (each read once, let go once its items are served)."""
        if not isinstance(planner, WeightsOnlyPlanner):  # DCP's own planner unpickles values with torch.load
            raise TypeError("hasten's DCP reader needs hasten's WeightsOnlyPlanner (values are read weights-only)")
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            read = self.opener(name)
            try:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    self._serve(read, item, planner)
            finally:
                self.release(name, read)
        done: Future = Future()
        done.set_result(None)
        return done

    def _serve(self, read: ReadFile, item: Any, planner: Any) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType

        from ..files import weights_only

        info = self.storage_data[item.storage_index]
        fqn = getattr(item.storage_index, "fqn", item.storage_index)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointCorruptError(f"{read.path!r} stores {fqn!r} through the transforms "
                                         f"{list(info.transform_descriptors)}; hasten reads only plain (uncompressed) "
                                         "DCP shards")
        offset, length = info.offset, info.length
        if offset < 0 or length < 0 or offset + length > read.size:
            raise CheckpointCorruptError(f"{fqn!r} is recorded at bytes {offset}..+{length} of {read.path!r}, which has "
                                         f"{read.size} bytes: the shard file was truncated or replaced")
        data = read.raw[offset:offset + length].numpy()
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(data.tobytes()))
            return
        tensor = weights_only.load_bytes(memoryview(data), f"tensor {fqn} (in {read.path!r})", "DCP tensor")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointCorruptError(f"{read.path!r} holds a {type(tensor).__name__} where the metadata records "
                                         f"the tensor {fqn!r}; the shard file is damaged")
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointCorruptError(f"{read.path!r} holds {fqn!r} with size {list(tensor.size())} where "
                                         f"{list(target.size())} is needed; the shard file is damaged")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values weights-only (``weights_only.load_bytes``: the
    allow-list unpickler, every size bounded by the value's bytes)."""

    def __init__(self, folder: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = folder  # to name the file a value came from

    def _file(self, read_item: Any) -> str:
        """The shard file holding the value (the folder when the metadata does not say)."""
        info = getattr(self.metadata, "storage_data", None) or {}
        stored = info.get(read_item.storage_index)
        return os.path.join(self.folder, stored.relative_path) if stored is not None else self.folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from ..files import weights_only

        fqn = read_item.dest_index.fqn
        where = f" (in {self._file(read_item)!r})" if self.folder else ""
        try:
            loaded = weights_only.load_bytes(value.getbuffer(), f"checkpoint value {fqn}{where}", "torch.save value")
        except unpickling.ForbiddenGlobal as e:
            raise unpickling.ForbiddenPickle(
                f"the checkpoint value {fqn!r}{where} holds more than tensors and plain Python values, which a "
                f"checkpoint save never stores, so it was tampered with; hasten refused to unpickle it and nothing "
                f"in it ran ({_why(e)})") from None
        except unpickling.ForbiddenPickle as e:
            raise unpickling.ForbiddenPickle(
                f"the checkpoint value {fqn!r} is not what a checkpoint save stores, so it was tampered with{where}; "
                f"hasten refused it and nothing in it ran ({_why(e)})") from None
        except CheckpointCorruptError as e:
            raise CheckpointCorruptError(f"the checkpoint value {fqn!r}{where} is damaged ({_why(e)})") from None
        # The parent stores the value where it belongs; it is given a pickle of what was just read safely.
        safe = io.BytesIO()
        torch.save(loaded, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def _why(error: BaseException) -> str:
    """The reason inside one of unpickling's messages ("... it <reason>; hasten refused ...")."""
    text = str(error)
    return text.split(": it ", 1)[-1].split("; hasten", 1)[0].split("; the checkpoint", 1)[0]


def load_folder(state: dict[str, Any], folder: str, group: Any = None) -> None:
    """``dcp.load(state, checkpoint_id=folder)`` without code from disk and with the folder checked
    first (``check_folder``, ``validate``): every process reads and checks ``.metadata`` itself
    before the collective load, so a bad folder stops each of them with the same error, and DCP's
    own failures come out as one ``CheckpointCorruptError`` on every process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_folder(folder)
    metadata = unpickling.dcp_metadata(os.path.join(folder, ".metadata"))
    validate(folder, metadata)
    try:
        dcp.load(state, storage_reader=MetadataReader(folder, metadata), planner=WeightsOnlyPlanner(folder),
                 process_group=group)
    except CheckpointException as e:
        raise wrapped(folder, e) from None
