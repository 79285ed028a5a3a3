"""Reading a checkpoint back: verify, compare with the live objects, then apply.

Everything that can be found wrong (sizes, checksums, counts, classes, tensor names and shapes) is
found by ``plan_*`` functions that only read; ``apply_*`` functions run only after every process
agreed that nothing is wrong, so a mismatch leaves the live training state untouched.
"""

from __future__ import annotations

import json
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from ..files.errors import CheckpointCorruptError, IncompleteCheckpointError
from ..files.reading import ReadFile, read_inside
from ..files.safetensors_format import SafetensorsView
from ..files.unpickling import ForbiddenGlobal, ForbiddenPickle, check_torch_bytes
from ..saving import ALIASES_KEY
from . import codec
from .saver import CLASS_KEY, SKELETON_KEY

_LIST = 8


def _listing(items: list) -> str:
    shown = ", ".join(str(i) for i in items[:_LIST])
    return shown + (f" and {len(items) - _LIST} more" if len(items) > _LIST else "")


class Reader:
    """The files of one checkpoint folder, each read once into private memory and verified against
    the manifest while it is read (``files.reading``): what is decoded and applied later is exactly
    what was verified, whatever happens to the files meanwhile."""

    def __init__(self, folder: str, manifest: dict[str, Any], pool: ThreadPoolExecutor) -> None:
        self.folder = folder
        self.manifest = manifest
        self.pool = pool
        self._read: dict[str, ReadFile] = {}
        self.checksums = True  # verify="size": sizes only

    def listed(self, name: str) -> dict[str, Any]:
        """The manifest's entry for ``name``; a clear error when the manifest lacks it."""
        info = self.manifest["files"].get(name)
        if info is None:
            raise IncompleteCheckpointError(
                f"checkpoint {self.folder!r} lacks {name!r}: its manifest does not list it, so the save that wrote "
                "it did not complete on every process; load an earlier checkpoint"
            )
        return info

    def file(self, name: str, checksum: bool = False) -> ReadFile:
        """The bytes of ``name``, read and verified (its size, and its checksum unless ``checksums`` is
        False, or ``checksum`` asks for it: a file first read after the load's verification, such as a
        DCP shard another process of the machine verified, is summed in the pass that reads it) on
        first use."""
        if name not in self._read:
            info = self.listed(name)
            try:
                summed = self.checksums or checksum
                self._read[name] = read_inside(self.folder, name, info["size"],
                                               info.get("checksum") if summed else None, pool=self.pool)
            except FileNotFoundError as e:
                raise IncompleteCheckpointError(f"{os.path.join(self.folder, name)!r} cannot be read ({e.strerror or e}); "
                                                "the checkpoint is incomplete") from None
        return self._read[name]

    def verify(self, names: list[str], checksums: bool = True) -> None:
        """Read and check ``names`` (and any file read later): sizes, and checksums unless ``checksums`` is False."""
        self.checksums = checksums
        for name in sorted(set(names), key=lambda n: -self.listed(n)["size"]):
            self.file(name)

    def release(self, name: str) -> None:
        """Drop the bytes of ``name`` (its state was applied)."""
        read = self._read.pop(name, None)
        if read is not None:
            read.close()

    def view(self, name: str) -> SafetensorsView:
        return SafetensorsView(self.file(name))

    def state(self, name: str, allow_pickle: bool = False) -> tuple[Any, Optional[str]]:
        """(state, class name) of a state file; ``.pt`` files need ``allow_pickle``."""
        if name.endswith(".pt"):
            return _unpickle(self, name, allow_pickle), None
        view = self.view(name)
        try:
            skeleton = json.loads(view.metadata.get(SKELETON_KEY, "null"))
            return codec.decode(skeleton, view.tensors()), view.metadata.get(CLASS_KEY)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
            raise CheckpointCorruptError(
                f"{os.path.join(self.folder, name)!r} is damaged: its state cannot be decoded ({type(e).__name__}: {e})"
            ) from None

    def close(self) -> None:
        for read in self._read.values():
            read.close()
        self._read.clear()


def _unpickle(reader: Reader, name: str, allow_pickle: bool) -> Any:
    import io

    path = os.path.join(reader.folder, name)
    raw = reader.file(name).bytes()
    # torch.load hands a TorchScript archive to torch.jit.load (its code runs), allow_pickle or not: the bytes
    # are checked first, and those very bytes are loaded.
    check_torch_bytes(raw, path, "torch.save")
    try:
        if not allow_pickle:  # hasten's allow-list unpickler: every size the file states bounded by the file
            from ..files import weights_only

            return weights_only.load_bytes(raw, path, "torch.save")
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
    except ForbiddenGlobal as e:
        why = str(e).split(": it ", 1)[-1].split("; hasten", 1)[0]
        raise pickle.UnpicklingError(
            f"{path!r} holds Python objects that only pickle can rebuild, and hasten does not run pickle from a "
            "checkpoint by default (it can execute code). If you trust this checkpoint, call "
            f"load_state(..., load_kwargs={{'weights_only': False}}). Details: it {why}") from None
    except ForbiddenPickle:
        raise
    except (Exception, RecursionError) as e:  # noqa: BLE001 - truncated or damaged bytes
        if isinstance(e, CheckpointCorruptError):
            raise
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or ["no message"]
        raise CheckpointCorruptError(f"{path!r} is not a readable torch.save file ({type(e).__name__}: "
                                     f"{lines[0][:200]}); the checkpoint is damaged or truncated") from None


# -- checks (read only) ---------------------------------------------------------------------------------
def check_counts(manifest: dict[str, Any], accelerator: Any) -> list[str]:
    """Objects of the checkpoint vs the live ones (models are checked after the load hooks).
    Dataloaders are not compared: a run loads the positions of those it has (``dataloader_note``)."""
    contents = manifest["contents"]
    problems = []
    live = {"optimizers": accelerator._optimizers, "schedulers": accelerator._schedulers,
            "custom_objects": accelerator._custom_objects}
    what = {"optimizers": "prepared optimizers", "schedulers": "prepared schedulers",
            "custom_objects": "objects given to register_for_checkpointing"}
    for key, objects in live.items():
        saved = contents[key]
        if len(saved) != len(objects):
            problems.append(f"it holds {len(saved)} {what[key]} but this run has {len(objects)}")
            continue
        for i, (entry, obj) in enumerate(zip(saved, objects)):
            if "class" in entry:
                from .saver import class_name

                if entry["class"] != class_name(obj):
                    problems.append(f"{key[:-1].replace('_', ' ')} {i} was a {entry['class']}, this run has a "
                                    f"{class_name(obj)}")
    return problems


def dataloader_note(folder: str, manifest: dict[str, Any], accelerator: Any) -> Optional[str]:
    """What ``load_state`` says when the run prepared another number of dataloaders than the
    checkpoint in ``folder`` holds positions for (a run that loads to evaluate often prepares none):
    the first ones are restored, the rest named."""
    saved, live = len(manifest["contents"]["dataloaders"]), len(accelerator._dataloaders)
    if saved == live:
        return None
    first, last = min(saved, live), max(saved, live)
    one = last - first == 1
    which = f"dataloader {first}" if one else \
        f"dataloaders {', '.join(str(i) for i in range(first, last - 1))} and {last - 1}"
    if saved > live:
        return (f"load_state: {folder!r} holds the positions of {saved} prepared dataloaders and this run prepared "
                f"{live}; the position{'' if one else 's'} of {which} {'was' if one else 'were'} not restored")
    return (f"load_state: this run prepared {live} dataloaders and {folder!r} holds the positions of {saved}; "
            f"{which} {'was' if one else 'were'} not restored and start{'s' if one else ''} at the beginning")


def check_model(view: SafetensorsView, model: torch.nn.Module, index: int) -> list[str]:
    shapes = view.shapes()
    aliases = json.loads(view.metadata.get(ALIASES_KEY, "{}"))
    for alias, canonical in aliases.items():
        if canonical in shapes:
            shapes.setdefault(alias, shapes[canonical])
    return check_shapes(shapes, model, f"model {index} ({type(model).__name__})")


def check_shapes(shapes: dict[str, tuple], model: torch.nn.Module, label: str) -> list[str]:
    """What differs between saved tensor names/shapes and ``model``'s state (one line per kind)."""
    pipelined = hasattr(model, "stage_state_dict")  # a pipeline's stages: the full model's names, other stages elsewhere
    live = model.stage_state_dict() if pipelined else model.state_dict(keep_vars=True)
    missing = [k for k in live if k not in shapes]
    unexpected = [k for k in shapes if k not in (model.full_state_names if pipelined else live)]
    wrong = [f"{k} (checkpoint {list(shapes[k])}, model {list(live[k].shape)})" for k in shapes
             if k in live and isinstance(live[k], torch.Tensor) and tuple(live[k].shape) != tuple(shapes[k])]
    problems = []
    if wrong:
        problems.append(f"{label}: shapes differ for {_listing(wrong)}")
    if missing:
        problems.append(f"{label}: missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        problems.append(f"{label}: in the checkpoint but not in the model: {_listing(unexpected)}")
    return problems


def model_state(view: SafetensorsView) -> dict[str, torch.Tensor]:
    state = view.tensors()
    for alias, canonical in json.loads(view.metadata.get(ALIASES_KEY, "{}")).items():
        if canonical in state:
            state[alias] = state[canonical]
    return state


def check_optimizer(saved: Any, optimizer: Any, index: int) -> list[str]:
    label = f"optimizer {index}"
    if not isinstance(saved, dict) or "param_groups" not in saved or "state" not in saved:
        return [f"{label}: the saved state is not an optimizer state dict"]
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(groups):
        return [f"{label}: {len(saved['param_groups'])} parameter groups saved, {len(groups)} in this run"]
    problems = []
    params = []
    for g, (s, live) in enumerate(zip(saved["param_groups"], groups)):
        if len(s["params"]) != len(live["params"]):
            problems.append(f"{label}: group {g} had {len(s['params'])} parameters, this run has {len(live['params'])}")
        params.extend(zip(s["params"], live["params"]))
    if problems:
        return problems
    wrong = []
    for pid, param in params:
        for key, value in (saved["state"].get(pid) or {}).items():
            if (isinstance(value, torch.Tensor) and value.dim() == param.dim() and value.dim() > 0
                    and tuple(value.shape) != tuple(param.shape)):
                wrong.append(f"{key} of parameter {pid} ({list(value.shape)} vs {list(param.shape)})")
    if wrong:
        problems.append(f"{label}: state shapes differ from the parameters: {_listing(wrong)}")
    return problems


# -- apply (after every process agreed) -----------------------------------------------------------
def _materialize(value: torch.Tensor, live: Any, device: torch.device) -> torch.Tensor:
    """Copy a read tensor into the live tensor when it fits (the live tensors stay the same objects and
    memory), else hand it over (already on ``device``) or copy it straight onto ``device``.

    One copy either way: a state read into host memory first and moved by the optimizer's
    ``load_state_dict`` would cross memory twice (a resume into an optimizer without state yet).
    """
    fits = (isinstance(live, torch.Tensor) and live.shape == value.shape and live.dtype == value.dtype
            and not live.requires_grad)
    if not fits and value.device == device:  # the verified bytes are this process's own memory: they become it
        return value
    dest = live if fits else torch.empty(value.shape, dtype=value.dtype, device=device)
    dest.copy_(value)
    return dest


def read_model_in_place(model: torch.nn.Module, view: SafetensorsView) -> bool:
    """Read a full model file straight into the model's tensors, as ``load_state_dict`` would copy
    them; False (nothing changed) unless every entry is a plain tensor of the saved dtype and shape
    and no module customises loading (hooks, ``_load_from_state_dict``): then the caller loads the
    usual way."""
    for module in model.modules():
        if (type(module)._load_from_state_dict is not torch.nn.Module._load_from_state_dict
                or module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks):
            return False
    live = model.state_dict(keep_vars=True)
    saved = model_state(view)
    if live.keys() != saved.keys():
        return False
    for name, tensor in live.items():
        value = saved[name]
        if (type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.dtype != value.dtype
                or tensor.shape != value.shape or not tensor.is_contiguous()):
            return False
    with torch.no_grad():
        for name, tensor in live.items():
            tensor.detach().copy_(saved[name])
    return True


def apply_optimizer(optimizer: Any, saved: dict[str, Any], models: list, strategy: Any,
                    ) -> None:
    """Load a full optimizer state decoded from a checkpoint file's verified bytes;
    the strategy loads it when its model is sharded."""
    inner = getattr(optimizer, "optimizer", optimizer)
    ids = {id(p) for g in inner.param_groups for p in g["params"]}
    owner = next((m for m in models if any(id(p) in ids for p in m.parameters())), None)
    if strategy.load_full_optimizer_state(owner, inner, saved):  # a full, numbered state into sharded parameters
        return
    live_state = optimizer.state_dict()["state"]
    params = {pid: p for saved_group, group in zip(saved["param_groups"], inner.param_groups)
              for pid, p in zip(saved_group["params"], group["params"])}
    state = {}
    for pid, entries in saved["state"].items():
        current = live_state.get(pid) or {}
        param = params.get(pid)
        state[pid] = {k: _materialize(v, current.get(k), _state_device(k, v, param))
                      if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _state_device(key: str, value: torch.Tensor, param: Optional[torch.Tensor]) -> torch.device:
    """Where ``Optimizer.load_state_dict`` will want an entry: on its parameter's device, except
    the step counter, which it keeps on the host unless the optimizer is fused or capturable (it
    moves it then, a scalar)."""
    if param is None or key == "step" or value.dim() == 0:
        return value.device
    return param.device


def detach_state(value: Any) -> Any:
    """Clone tensors out of a decoded state (so no file's bytes stay in memory after loading)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: detach_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [detach_state(v) for v in value]
    if isinstance(value, tuple):
        return tuple(detach_state(v) for v in value)
    return value


def apply_gradients(accelerator: Any, grads: dict[str, torch.Tensor]) -> None:
    wanted = {}
    for i, model in enumerate(accelerator._models):
        inner = accelerator.unwrap_model(model, keep_torch_compile=False)
        for name, param in inner.named_parameters():
            wanted[f"{i}:{name}"] = param
    for key, param in wanted.items():
        value = grads.get(key)
        if value is None:
            param.grad = None
        elif param.grad is not None and param.grad.shape == value.shape:
            param.grad.copy_(value)
        else:
            param.grad = value.to(device=param.device, dtype=param.dtype).clone()


def check_gradients(grads_view: SafetensorsView, accelerator: Any) -> list[str]:
    shapes = grads_view.shapes()
    params = {}
    for i, model in enumerate(accelerator._models):
        inner = accelerator.unwrap_model(model, keep_torch_compile=False)
        for name, param in inner.named_parameters():
            params[f"{i}:{name}"] = tuple(param.shape)
    bad = [k for k, s in shapes.items() if params.get(k) != s]
    return [f"saved gradients do not fit the parameters: {_listing(bad)}"] if bad else []
