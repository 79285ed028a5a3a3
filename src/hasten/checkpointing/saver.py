"""What a checkpoint holds, and writing one process's share of it into the temporary folder.

File names (``i`` > 0 gets a suffix, as in Accelerate): ``model.safetensors``, ``model_1...``;
``optimizer.safetensors``; ``scheduler.safetensors``; ``scaler.safetensors``;
``custom_checkpoint_{i}.safetensors`` (``.pt`` for objects whose state needs pickle); per process
``rank_{r}.safetensors`` (RNG states, dataloader positions, step counter) and, when saved inside a
gradient-accumulation window, ``grads_rank_{r}.safetensors``. Shared files are written by one
process (per node with ``save_on_each_node``), per-process files by their process, so no two
processes ever write the same name.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from typing import Any, NamedTuple, Optional

import torch

from ..saving import ALIASES_KEY, find_aliases
from . import codec, rng
from ..files.safetensors_format import write_bytes, write_safetensors
from ..warning_kinds import HastenWarning

SKELETON_KEY = "hasten_skeleton"
CLASS_KEY = "hasten_class"


def indexed(stem: str, index: int, ext: str = ".safetensors") -> str:
    return f"{stem}{ext}" if index == 0 else f"{stem}_{index}{ext}"


def rank_file(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def grads_file(rank: int) -> str:
    return f"grads_rank_{rank}.safetensors"


def class_name(obj: Any) -> str:
    """The user's class of a prepared optimizer/scheduler (any wrapper's, DeepSpeed's included), else ``obj``'s."""
    wrappers = {c.__name__ for c in type(obj).__mro__}
    inner = getattr(obj, "optimizer", None) if "AcceleratedOptimizer" in wrappers else None
    inner = inner or (getattr(obj, "scheduler", None) if "AcceleratedScheduler" in wrappers else None)
    return type(inner or obj).__name__


class Item(NamedTuple):
    """One file of a checkpoint, ready to write: tensors + header metadata, or raw bytes (pickle)."""

    name: str
    tensors: Optional[dict[str, torch.Tensor]] = None
    metadata: Optional[dict[str, str]] = None
    data: Optional[bytes] = None


def state_item(name: str, state: Any, class_: Optional[str] = None) -> Item:
    """A state dict as tensors + JSON skeleton (raises ``codec.NotEncodable``)."""
    skeleton, tensors = codec.encode(state)
    metadata = {SKELETON_KEY: json.dumps(skeleton, separators=(",", ":"))}
    if class_ is not None:
        metadata[CLASS_KEY] = class_
    return Item(name, tensors, metadata)


def pickled_item(name: str, state: Any) -> Item:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return Item(name, data=buffer.getvalue())


class Writer:
    """Writes items into one folder and remembers their sizes and checksums."""

    def __init__(self, folder: str, rank: int) -> None:
        self.folder = folder
        self.rank = rank
        self.files: dict[str, dict[str, Any]] = {}

    def write(self, item: Item) -> None:
        path = os.path.join(self.folder, item.name)
        if item.data is not None:
            size, checksum = write_bytes(path, item.data)
        else:
            size, checksum = write_safetensors(path, item.tensors or {}, item.metadata)
        self.files[item.name] = {"size": size, "checksum": checksum, "rank": self.rank}


def model_payload(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors to store (tied names once) and the metadata recording the ties."""
    aliases = find_aliases(state_dict)
    tensors = {}
    for name, value in state_dict.items():
        if name in aliases:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"save_state: model state entry {name!r} is a {type(value).__name__}, not a tensor")
        tensors[name] = value
    # Views into a bigger storage or sharing one are fine: the writer stores each view's own bytes.
    metadata = {"format": "pt"}
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    return tensors, metadata


def loader_info(dataloader: Any, num_processes: int) -> dict[str, Any]:
    """What a position conversion needs when the number of processes changes on resume."""
    info: dict[str, Any] = {"class": type(dataloader).__name__, "num_processes": num_processes}
    for key in ("total_batch_size", "total_dataset_length"):
        try:
            value = getattr(dataloader, key)
        except (TypeError, AttributeError, NotImplementedError):
            value = None
        info[key] = int(value) if isinstance(value, int) else None
    info["split_batches"] = bool(getattr(dataloader, "split_batches", False))
    return info


def shared_items(weights: list[dict], accelerator: Any, contents: dict[str, Any], backend: Any = None) -> list[Item]:
    """Models, optimizers, schedulers, scaler and registered objects (one process per folder);
    ``backend``: the checkpoint backend that stores the models (None: full files here)."""
    items = []
    for i, state_dict in enumerate(weights):
        tensors, metadata = model_payload(state_dict)
        items.append(Item(contents["models"][i]["file"], tensors, metadata))
    for i, opt in enumerate(accelerator._optimizers):
        if backend is not None and backend.KEY in contents["optimizers"][i]:
            continue  # the backend stores it (sharded files, the engine checkpoint)
        items.append(state_item(contents["optimizers"][i]["file"], opt.state_dict(), contents["optimizers"][i]["class"]))
    for i, sched in enumerate(accelerator._schedulers):
        items.append(state_item(contents["schedulers"][i]["file"], sched.state_dict(), contents["schedulers"][i]["class"]))
    if contents["scaler"] is not None:
        items.append(state_item(contents["scaler"], accelerator.precision.state_dict(), "GradScaler"))
    for i, obj in enumerate(accelerator._custom_objects):
        entry = contents["custom_objects"][i]
        state = obj.state_dict()
        items.append(pickled_item(entry["file"], state) if entry["pickle"] else state_item(entry["file"], state, entry["class"]))
    return items


def plan_custom(objects: list[Any]) -> list[dict[str, Any]]:
    """File name and format of each registered object (pickle only where JSON + tensors cannot hold it)."""
    entries = []
    for i, obj in enumerate(objects):
        name = type(obj).__name__
        try:
            codec.encode(obj.state_dict())
        except codec.NotEncodable as e:
            warnings.warn(
                f"register_for_checkpointing object {i} ({name}): its state needs pickle ({e}); it is saved as "
                f"custom_checkpoint_{i}.pt and loading it needs load_state(..., load_kwargs={{'weights_only': False}}) "
                "(only for checkpoints you trust). Return tensors, numbers, strings, lists and dicts from "
                "state_dict() to avoid this", HastenWarning,
                stacklevel=4,
            )
            entries.append({"file": f"custom_checkpoint_{i}.pt", "class": name, "pickle": True})
            continue
        entries.append({"file": f"custom_checkpoint_{i}.safetensors", "class": name, "pickle": False})
    return entries


def process_items(accelerator: Any, rng_state: dict[str, Any], mid_window: bool) -> list[Item]:
    """This process's own files: ``rank_<r>`` and, inside an accumulation window, ``grads_rank_<r>``."""
    rank = accelerator.process_index
    items = [state_item(rank_file(rank), rank_state(accelerator, rng_state))]
    if mid_window:
        items.append(Item(grads_file(rank), gradients(accelerator)))
    return items


def rank_state(accelerator: Any, rng_state: dict[str, Any]) -> dict[str, Any]:
    return {
        "rng": rng_state,
        "dataloaders": [_loader_state(dl) for dl in accelerator._dataloaders],
        "step": int(accelerator.step),
        "process_index": int(accelerator.process_index),
    }


def _loader_state(dataloader: Any) -> dict[str, Any]:
    if hasattr(dataloader, "exact_resume_state"):
        return dataloader.exact_resume_state()
    return dataloader.state_dict() if hasattr(dataloader, "state_dict") else {}


def gradients(accelerator: Any) -> dict[str, torch.Tensor]:
    """This process's accumulated gradients: ``"<model index>:<parameter name>"`` -> grad."""
    out = {}
    for i, model in enumerate(accelerator._models):
        inner = accelerator.unwrap_model(model, keep_torch_compile=False)
        for name, param in inner.named_parameters():
            if param.grad is not None:
                out[f"{i}:{name}"] = param.grad
    return out


def capture_rng() -> dict[str, Any]:
    return rng.capture()
