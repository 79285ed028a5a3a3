"""The checked files of a weights checkpoint: a ``.safetensors`` file, a ``.bin``/``.pt`` state dict
(``weights_only=True``), a sharded ``*.index.json`` or a folder holding one of those under
transformers' names. Each file is a plain file read once and verified (``files.weights``) before any
model changes; what ``load_checkpoint_in_model`` then copies are those verified bytes. The sharded
loader (``strategies/shard_loading.py``) asks for ``ranged`` sources instead: of a safetensors file
only the header is read and checked, and the file is held open for the parts each process reads
(``files.ranged``: verified block by block where ``save_model`` recorded block checksums).
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any, Mapping, Optional, Sequence

from .accelerate_channels import log_warning
from .files.errors import CheckpointCorruptError
from .files.paths import hub_blob, read_inside, split
from .files.weights import CHECKSUM_KEY, CHECKSUMS_KEY, read_weights, self_checksum
from .saving import (
    ALIASES_KEY,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAVE_ID_KEY,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    PathLike,
    _listing,
)


class Source:
    """One weights file, checked: its names and shapes; a ``.bin``'s contents (``data``); a
    safetensors file's ``view`` of its verified bytes (``files.reading``), kept from the check or,
    when dropped to bound memory, read again at use and required to be the same bytes; or, for a
    sharded load, the file held open with only its header read (``ranged``, ``files.ranged``), whose
    ``blocks`` read and verify the parts asked for."""

    def __init__(self, path: str, safe: bool, shapes: dict[str, Optional[tuple]], data: Optional[dict] = None,
                 view: Any = None, found: Optional[str] = None, ranged: Any = None) -> None:
        self.path, self.safe, self.shapes, self.data = path, safe, shapes, data
        self._view, self.found = view, found  # found: the checksum of the bytes that were checked
        self.ranged = ranged

    def blocks(self, wanted: Sequence[tuple[str, tuple]]) -> list:
        """The blocks ``wanted`` ((key, tuple of slices) each) of this file's tensors: read alone from
        the open file (``ranged``), else taken from the file's verified bytes or the state dict."""
        if self.ranged is not None:
            return self.ranged.blocks(wanted)
        if not self.safe:
            return [self.data[key][index] for key, index in wanted]
        view = self.view
        return [view.tensor(key)[index] for key, index in wanted]

    @property
    def view(self) -> Any:
        if self._view is None:
            view = read_weights(self.path, found=True).view
            if view.found != self.found or view.shapes() != self.shapes:
                raise CheckpointCorruptError(f"{self.path!r} changed after it was checked (replaced or rewritten while "
                                             "the weights were loaded); load it again")
            self._view = view
        return self._view

    def release(self) -> None:
        """Let go of the bytes (tensors already taken from them keep their part) and of an open file."""
        self._view = None
        if self.ranged is not None:
            self.ranged.close()


def verify_weights_file(path: str) -> Optional[str]:
    """Check a safetensors weights file before it is read: a plain file, a whole header, and the
    checksum ``save_model`` recorded in it.
    Returns the recorded checksum; None for a file written without one (it cannot be verified)."""
    return read_weights(path).recorded


def _aliases(path: str, metadata: dict[str, str]) -> dict[str, str]:
    try:
        aliases = json.loads(metadata[ALIASES_KEY]) if ALIASES_KEY in metadata else {}
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{path!r} records damaged tied names ({ALIASES_KEY}: {e}); the file is "
                                     "damaged") from None
    if not isinstance(aliases, dict):
        raise CheckpointCorruptError(f"{path!r} records damaged tied names ({ALIASES_KEY}); the file is damaged")
    return aliases


def read_source(path: str, keep: bool = True,
                ranged: bool = False) -> tuple[Source, dict[str, str], Optional[str], Optional[str]]:
    """Names and shapes of one weights file, plus its recorded aliases, save id and checksum.
    ``keep``: keep the verified bytes for loading (else they are read again then, and compared).
    ``ranged``: read a safetensors file's header only and keep the file open, to read parts of it
    (``files.ranged``), unless it records a checksum of its whole bytes only (older hasten: read whole)."""
    if path.endswith(".safetensors"):
        if ranged:
            from .files.ranged import RangedWeights

            part = RangedWeights(path)
            if not part.whole_only:
                try:
                    aliases = _aliases(path, part.metadata)
                except BaseException:
                    part.close()
                    raise
                source = Source(path, True, part.shapes(), ranged=part)
                return source, aliases, part.metadata.get(SAVE_ID_KEY), part.recorded
            part.close()
        file = read_weights(path, found=not keep)
        view = file.view
        metadata = view.metadata
        aliases = _aliases(path, metadata)
        source = Source(path, True, view.shapes(), None, view if keep else None, file.found)
        return source, aliases, metadata.get(SAVE_ID_KEY), file.recorded
    import torch

    from .files import unpickling, weights_only

    folder, name = hub_blob(path) or split(path)
    try:  # hasten's allow-list unpickler, every size bounded by the file, from one checked copy of a plain file
        data = weights_only.load(os.path.join(folder, name))
    except unpickling.ForbiddenGlobal as e:
        raise pickle.UnpicklingError(
            f"{path!r} holds objects other than tensors and plain containers, so hasten will not unpickle "
            f"it (weights_only=True). If you trust the file, load it with torch.load(weights_only=False) "
            f"and call model.load_state_dict. Details: {e}"
        ) from e
    except (unpickling.ForbiddenPickle, CheckpointCorruptError):
        raise  # a crafted size, a TorchScript archive, a link or a damaged file, named with the file
    except Exception as e:  # noqa: BLE001 - EOFError, zip errors, ...: none names the file
        raise CheckpointCorruptError(f"cannot read {path!r} ({type(e).__name__}: {e}); the file is damaged or not a "
                                     "torch state dict") from None
    if not isinstance(data, Mapping) or any(isinstance(v, Mapping) for v in data.values()):
        inner = [k for k, v in data.items() if isinstance(v, Mapping)] if isinstance(data, Mapping) else []
        raise ValueError(
            f"{path!r} is not a state dict (name -> tensor)"
            + (f": {_listing(inner)} hold nested dicts; pass e.g. torch.load(...)[{inner[0]!r}] to "
               "model.load_state_dict instead" if inner else f" but a {type(data).__name__}")
        )
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in data.items()}
    return Source(path, False, shapes, dict(data)), {}, None, None


def read_weights_index(path: str) -> tuple[dict[str, Any], Optional[dict[str, str]]]:
    """A sharded checkpoint's index, checked: a plain file, its own checksum (when ``save_model``
    wrote it), shard names that stay in its folder. Returns it and the shards' recorded checksums
    (None for an index written without them, e.g. by transformers: the shards cannot be verified
    against it)."""
    import torch

    folder, name = hub_blob(path) or split(path)
    data = read_inside(folder, name, "checkpoint index", nested=False)
    try:
        index = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"index {path!r} is not readable JSON ({type(e).__name__}: {e}); the file is "
                                     "damaged") from None
    if isinstance(index, dict) and index and "weight_map" not in index and all(isinstance(v, str) for v in index.values()):
        index = {"weight_map": index}  # the bare form (tensor name -> shard file), which Accelerate reads too
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ValueError(f"index {path!r} has no 'weight_map'; it is not a sharded checkpoint index")
    metadata = index.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CheckpointCorruptError(f"index {path!r} has a damaged 'metadata' entry")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    recorded = self_checksum(raw, len(data), path)
    checksums = metadata.get(CHECKSUMS_KEY)
    if checksums is not None and (recorded is None or not isinstance(checksums, dict)):
        raise CheckpointCorruptError(f"index {path!r} has damaged checksums ({CHECKSUMS_KEY} without a valid "
                                     f"{CHECKSUM_KEY}); the file is damaged")
    for name, filename in index["weight_map"].items():
        if (not isinstance(filename, str) or not filename or filename in (".", "..") or "/" in filename
                or "\\" in filename or "\0" in filename or os.path.isabs(filename)):
            raise CheckpointCorruptError(f"index {path!r} puts {name!r} in {filename!r}, which is not a file name in "
                                         "the index's folder; an index written by save_model names only such files, "
                                         "so it is damaged or crafted (nothing was read)")
    return index, checksums


def _memory_budget() -> int:
    """Bytes of checked weights files kept in memory for loading: half the memory available now. Files
    beyond it are read again when loaded (and must be the same bytes), one at a time."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 1 << 30


def checkpoint_sources(checkpoint: PathLike, release: bool = False,
                       ranged: bool = False) -> tuple[list[Source], dict[str, str]]:
    """The checked weights files of ``checkpoint`` and its recorded aliases; ``release``: keep none of
    their bytes (each is read again, verified, when loaded); ``ranged``: read the headers of safetensors
    files only and keep them open, to read parts of them (``read_source``: a sharded load takes slices
    of each). On an error, every file opened is closed."""
    sources: list[Source] = []
    try:
        return _checkpoint_sources(checkpoint, release, ranged, sources)
    except BaseException:
        for source in sources:
            source.release()
        raise


def _checkpoint_sources(checkpoint: PathLike, release: bool, ranged: bool,
                        sources: list[Source]) -> tuple[list[Source], dict[str, str]]:
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        candidates = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
        found = next((os.path.join(path, c) for c in candidates if os.path.lexists(os.path.join(path, c))), None)
        indexes = [] if found else sorted(f for f in os.listdir(path) if f.endswith(".index.json"))
        if len(indexes) > 1:
            raise ValueError(f"checkpoint directory {path!r} holds several indexes {indexes}; pass the one to load")
        found = found or (os.path.join(path, indexes[0]) if indexes else None)  # a sharded checkpoint of any name
        if found is None:
            raise FileNotFoundError(
                f"checkpoint directory {path!r} holds none of {', '.join(candidates)}; pass the directory "
                "given to save_model / save_pretrained, or the weights file itself"
            )
        path = found
    if not os.path.lexists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; pass a weights file or a directory")
    budget = [0 if release else _memory_budget()]

    def keep(file: str) -> bool:
        try:
            budget[0] -= os.stat(file).st_size  # an estimate for the budget only; the read is checked
        except OSError:
            pass
        return budget[0] >= 0

    if not path.endswith(".index.json"):
        source, aliases, _, _ = read_source(path, keep(path), ranged)
        sources.append(source)
        return sources, aliases
    index, checksums = read_weights_index(path)
    metadata = index.get("metadata") or {}
    aliases = dict(metadata.get(ALIASES_KEY) or {})
    save_id = metadata.get(SAVE_ID_KEY)
    directory = os.path.dirname(path)
    for filename in dict.fromkeys(index["weight_map"].values()):
        shard = os.path.join(directory, filename)
        if not os.path.lexists(shard):
            raise FileNotFoundError(f"index {path!r} lists shard {filename!r}, which is missing; the checkpoint is incomplete")
        if checksums is not None and filename not in checksums:
            raise CheckpointCorruptError(f"index {path!r} lists shard {filename!r} but records no checksum for it; the "
                                         "index is damaged")
        source, shard_aliases, shard_id, recorded = read_source(shard, keep(shard), ranged)
        sources.append(source)
        if save_id is not None and shard_id is not None and shard_id != save_id:
            raise RuntimeError(
                f"shard {shard!r} was written by a different save than index {path!r} (an interrupted "
                "save?); the checkpoint mixes two saves, save it again"
            )
        if checksums is not None and recorded != checksums[filename]:
            raise CheckpointCorruptError(f"{shard!r} records checksum {recorded}, but the index {path!r} records "
                                         f"{checksums[filename]}: the file was replaced or damaged; save the weights again")
        absent = [n for n, fn in index["weight_map"].items() if fn == filename and n not in source.shapes]
        if absent:
            raise ValueError(f"index {path!r} says {_listing(absent)} are in {filename!r}, but that file lacks them")
        aliases.update(shard_aliases)
    return sources, aliases


def fit_problems(mismatched: Sequence[str], missing: Sequence[str], unexpected: Sequence[str],
                 strict: bool) -> list[str]:
    """What keeps a checkpoint from fitting a model: shapes always, missing/extra keys under ``strict``
    (shared by the plain and the sharded loader, so both word them alike)."""
    problems = []
    if mismatched:
        problems.append(f"shapes differ for {_listing(mismatched)}")
    if strict and missing:
        problems.append(f"missing from the checkpoint: {_listing(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not in the model: {_listing(unexpected)}")
    return problems


def log_partial_load(checkpoint: PathLike, model: Any, missing: Sequence[str], unexpected: Sequence[str]) -> None:
    """Report a non-strict load that left keys out: a WARNING record on ``hasten.utils.modeling``, where
    Accelerate logs its record about unused weights (with its words), so code that watches the log sees
    it and ``-W error`` does not make it an exception. Missing keys, which Accelerate does not report,
    are named in the same record."""
    if not (missing or unexpected):
        return
    where, name = os.fspath(checkpoint), type(model).__name__
    parts = []
    if unexpected:
        parts.append(f"Some weights of the model checkpoint at {where} were not used when initializing {name}: "
                     f"{list(unexpected)}.")
    if missing:
        parts.append(f"load_checkpoint_in_model: {where!r} lacks {_listing(missing)} for {name}.")
    parts.append("The matching weights were loaded (strict=True makes this an error).")
    log_warning("hasten.utils.modeling", " ".join(parts))
