"""Models and optimizers of a checkpoint as torch.distributed.checkpoint (DCP) shards.

Strategies whose ``checkpoint_backend()`` is this module (FSDP2, TP, models the user sharded)
store their models and optimizers in ``<checkpoint>/sharded/``: every process writes its own shards
(``__<rank>_0.distcp``, fsynced), process 0 the ``.metadata``, all inside the checkpoint's
temporary folder, before the manifest is written and the folder renamed. Keys are
``model_<i>.<parameter name>`` and ``optimizer_<i>.state.<parameter name>.<key>``, with the
parameter names of the plain model, so any layout (1 process, DDP, FSDP2 over N) reads them
back: DCP reshards on load. Reading checks names and global shapes against the live objects
before anything is changed.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

import torch
from torch import nn

from ..activation_checkpointing import strip_checkpoint_prefix
from ..files import unpickling
from ..files.reading import file_checksum
SUBDIR = "sharded"
KEY = "dcp"  # the manifest key of entries stored here


def _owner(models: list[nn.Module], optimizer: Any) -> nn.Module:
    """The prepared model whose parameters ``optimizer`` updates."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in models:
        if any(id(p) in ids for p in model.parameters()):
            return model
    raise ValueError(f"optimizer {type(optimizer).__name__} updates no parameter of a prepared model; a sharded "
                     "checkpoint stores optimizer state by parameter name, so prepare its model too")


def _optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter names. One without state (plain SGD, any optimizer
    before its first step) is stored as its parameter groups alone: DCP's helper would first give it
    a state by taking a zero step (Adam would then resume at step 1)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if _pipelined(model):
        return _stage_optimizer_state(model, optimizer)
    if optimizer.state:
        return get_optimizer_state_dict(model, optimizer)
    names = _names(model)
    groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[names[id(p)] for p in g["params"]])
              for g in optimizer.param_groups]
    return {"state": {}, "param_groups": groups}


def _pipelined(model: nn.Module) -> bool:
    """A ``PipelinedModel``: this process's stages, whose state is stored under the full model's names."""
    return hasattr(model, "named_stage_parameters") and hasattr(model, "stage_state_dict")


def _model_state(model: nn.Module) -> dict[str, Any]:
    """The model's state dict keyed by the plain model's names; a pipelined model's holds its own
    stages' entries only (the live tensors: DCP reads into them), the other processes hold the rest."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return model.stage_state_dict() if _pipelined(model) else get_model_state_dict(model)


def _stage_optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer state of this process's stages keyed by the original parameter names (each
    process a disjoint part), and the parameter groups with the names of *every* stage's parameters
    (recorded when the optimizer was prepared), the same on every process: DCP stores them once and
    any layout (one process, another pipeline) maps its groups back by name."""
    from ..pipeline.model import group_names

    names = {id(p): n for n, p in model.named_stage_parameters()}
    full = group_names(optimizer) or [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    state = {names[id(p)]: dict(s) for p, s in optimizer.state.items() if s}
    groups = [dict({k: v for k, v in g.items() if k != "params"}, params=list(n))
              for g, n in zip(optimizer.param_groups, full)]
    return {"state": state, "param_groups": groups}


def _stage_optimizer_target(model: nn.Module, optimizer: Any, saved: dict[str, Any], name: str) -> dict[str, Any]:
    """What DCP reads this process's part of optimizer ``name`` into: a tensor of the stored shape and
    dtype for each state entry of a local parameter, a placeholder for everything else it stored."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    local = dict(model.named_stage_parameters())
    prefix = f"{name}.state."
    state: dict[str, dict[str, Any]] = {}
    for key, meta in saved.items():
        if not key.startswith(prefix):
            continue
        param, _, field = key[len(prefix):].rpartition(".")
        if param in local:
            state.setdefault(param, {})[field] = (_state_target(local[param], meta)
                                                  if isinstance(meta, TensorStorageMetadata) else None)
    groups = _saved_groups(saved, name)[1]
    return {"state": state, "param_groups": [dict.fromkeys(groups[g]) for g in sorted(groups)]}


def _state_target(param: torch.Tensor, meta: Any) -> torch.Tensor:
    """Where DCP reads one stored optimizer state entry of ``param``: for a parameter sharded over its stage
    (FSDP2, tensor parallel: a DTensor) an entry of its shape is sharded as the parameter is, so each process
    reads its own shard and Adam's moments match the DTensor gradients; else a plain tensor of the stored shape."""
    size, dtype = tuple(meta.size), meta.properties.dtype
    if hasattr(param, "device_mesh") and hasattr(param, "placements") and size == tuple(param.shape):
        from torch.distributed.tensor import empty

        return empty(size, dtype=dtype, device_mesh=param.device_mesh, placements=param.placements)
    return torch.empty(size, dtype=dtype)


def _load_stage_optimizer_state(model: nn.Module, optimizer: Any, stored: dict[str, Any]) -> None:
    """``stored`` (by name) into ``optimizer`` with ``Optimizer.load_state_dict`` (its casts and checks),
    numbered as this process's groups hold the parameters; the saved hyperparameters."""
    names = {id(p): n for n, p in model.named_stage_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {i: stored["state"][n] for i, n in enumerate(order) if n in stored["state"]}
    groups, at = [], 0
    for live, saved in zip(optimizer.param_groups, stored["param_groups"]):
        count = len(live["params"])
        groups.append(dict({k: v for k, v in saved.items() if k != "params"}, params=list(range(at, at + count))))
        at += count
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _names(model: nn.Module) -> dict[int, str]:
    if _pipelined(model):
        return {id(p): n for n, p in model.named_stage_parameters()}
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), strip_checkpoint_prefix(name))
    return names


def _targets(models: list[nn.Module], optimizers: list[Any], with_optimizers: list[bool]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i, model in enumerate(models):
        state[f"model_{i}"] = _model_state(model)
    for i, (opt, wanted) in enumerate(zip(optimizers, with_optimizers)):
        if wanted:
            inner = getattr(opt, "optimizer", opt)
            state[f"optimizer_{i}"] = _optimizer_state(_owner(models, inner), inner)
    return state


def entries(models: list[nn.Module], optimizers: list[Any]) -> tuple[list[dict], list[bool]]:
    """Manifest entries of the models, and which optimizers to store (all: at least their
    parameter groups, so a learning rate set by a scheduler survives a resume)."""
    return [{"dcp": f"model_{i}"} for i in range(len(models))], [True] * len(optimizers)


def save(folder: str, models: list[nn.Module], optimizers: list[Any], with_state: list[bool],
         group: Any = None) -> dict[str, str]:
    """Every process writes its shards of the models and optimizers into ``folder/sharded``."""
    return write(folder, _targets(models, optimizers, with_state), group)


def write(folder: str, state: dict[str, Any], group: Any = None) -> dict[str, str]:
    """Every process writes its shards of ``state`` into ``folder/sharded`` and fsyncs them; returns
    the checksums of the files it wrote (``{manifest name: checksum}``), computed while they are
    still in the page cache, for the manifest."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = os.path.join(folder, SUBDIR)
    os.makedirs(path, exist_ok=True)
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)
    # One process has nothing to exchange. DCP would still run its object collectives on the default
    # group, the training's: from a background save's thread that drives the training's communicator
    # (NCCL on CUDA) from two threads at once. Several processes get the save's own group.
    alone = group is None and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    dcp.save(state, storage_writer=writer, process_group=group, no_dist=alone)
    # DCP names each process's file after its rank in the group (``__<rank>_0.distcp``); its rank 0
    # writes ``.metadata``. Files nobody claims are checksummed by the committing process.
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    mine = [n for n in os.listdir(path) if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
    mine += [".metadata"] if rank == 0 else []
    return {f"{SUBDIR}/{n}": file_checksum(os.path.join(path, n)) for n in mine}


def writer(acc: Any, folder: str, inner: list[nn.Module], with_state: list[bool], group: Any,
           stager: Any = None) -> Any:
    """The collective write of ``save_state``, run once every process is ready.

    With a ``stager`` (``save_state(blocking=False)``) each process copies its shards into host
    buffers now, so training may go on changing the live ones while a background thread writes
    the copies (over ``group``, the save's own process group).
    """
    import functools

    optimizers = list(acc._optimizers)
    if stager is None:
        return functools.partial(save, folder, inner, optimizers, with_state, group)
    return functools.partial(write, folder, stager.stage_tree(_targets(inner, optimizers, with_state)), group)


def files(folder: str) -> dict[str, dict[str, Any]]:
    """Manifest records of the DCP files (sizes; the checksums come from the processes that wrote them)."""
    path = os.path.join(folder, SUBDIR)
    out = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            out[f"{SUBDIR}/{name}"] = {"size": os.path.getsize(full), "checksum": None, "rank": "dcp"}
    return out


def read_metadata(folder: str, files: Any = None) -> Any:
    """DCP's ``.metadata`` of ``folder``, read with the allow-list of ``unpickling`` (never
    ``pickle.load``: a replaced file could run code); from the verified bytes of ``files`` (the load's
    ``restorer.Reader``) when given."""
    from .dcp_reader import check_folder, validate

    path = os.path.join(folder, SUBDIR)
    check_folder(path)
    data = None
    if files is not None:
        data = files.file(f"{SUBDIR}/.metadata", checksum=True).bytes()
        files.release(f"{SUBDIR}/.metadata")
    metadata = unpickling.dcp_metadata(os.path.join(path, ".metadata"), data)
    validate(path, metadata)  # paths inside the folder, records within the files, sizes backed by bytes
    return metadata


class Reader:
    """Reads one checkpoint's shards for one ``load_state``: ``check``, then ``load``, from a single
    read of ``.metadata`` (it can be large: one record per tensor shard).

    ``backends.reader_for`` makes one per load and the load holds it from the check to the load; a
    file replaced in between is read again.
    """

    KEY = KEY

    def __init__(self) -> None:
        self._read: Optional[tuple[str, tuple, Any]] = None  # (folder, file identity, Metadata)
        self.files: Any = None  # the load's restorer.Reader: the checkpoint's files read and verified once

    def read_through(self, files: Any) -> None:
        """Read ``.metadata`` and the shard files from ``files`` (a ``restorer.Reader``: each file's bytes read
        once and checked against the manifest), never again by path."""
        self.files = files

    def metadata(self, folder: str) -> Any:
        if self.files is not None:  # the verified bytes: a file replaced since cannot change them
            identity: tuple = ("verified",)
        else:
            info = os.stat(os.path.join(folder, SUBDIR, ".metadata"))
            identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        if self._read is None or self._read[:2] != (folder, identity):
            self._read = (folder, identity, read_metadata(folder, self.files))
        return self._read[2]

    def check(self, folder: str, contents: dict[str, Any], models: list[nn.Module], optimizers: list[Any]) -> list[str]:
        return check(folder, contents, models, optimizers, metadata=self.metadata(folder))

    def load(self, folder: str, contents: dict[str, Any], models: list[nn.Module], optimizers: list[Any],
             group: Any = None) -> None:
        metadata = self.metadata(folder)
        self._read = None  # used: nothing keeps the records once the shards are read
        load(folder, contents, models, optimizers, group, metadata=metadata, files=self.files)


def check(folder: str, contents: dict[str, Any], models: list[nn.Module], optimizers: list[Any],
          metadata: Any = None) -> list[str]:
    """Differences between the stored shards and the live models/optimizers (reads only);
    ``metadata``: the folder's ``read_metadata`` when the caller has it already."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = (metadata if metadata is not None else read_metadata(folder)).state_dict_metadata
    problems = []
    for i, model in enumerate(models):
        prefix = f"model_{i}."
        live = _model_state(model)
        stored = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
        missing = [k for k in live if k not in stored]
        # a pipeline stage holds part of the model: what is stored must belong to the full model
        known = model.full_state_names if _pipelined(model) else live
        unexpected = [k for k in stored if k not in known]
        wrong = [f"{k} (checkpoint {list(stored[k].size)}, model {list(v.shape)})" for k, v in live.items()
                 if k in stored and isinstance(stored[k], TensorStorageMetadata) and isinstance(v, torch.Tensor)
                 and tuple(stored[k].size) != tuple(v.shape)]
        label = f"model {i} ({type(model).__name__})"
        for what, names in (("shapes differ for", wrong), ("missing from the checkpoint:", missing),
                            ("in the checkpoint but not in the model:", unexpected)):
            if names:
                problems.append(f"{label}: {what} {', '.join(names[:8])}" + (f" and {len(names) - 8} more"
                                                                          if len(names) > 8 else ""))
    for i, opt in enumerate(optimizers):
        entry = contents["optimizers"][i]
        if not entry.get("dcp"):
            continue
        inner = getattr(opt, "optimizer", opt)
        groups = _saved_groups(saved, entry["dcp"])[1]
        if len(groups) != len(inner.param_groups):
            problems.append(f"optimizer {i}: {len(groups)} parameter groups saved, {len(inner.param_groups)} in "
                            "this run")
        owner = _owner(models, inner)
        if _pipelined(owner):
            names = dict(owner.named_stage_parameters())
            others = owner.full_state_names  # stored for the other stages: read there
        else:
            names = {strip_checkpoint_prefix(n): p for n, p in owner.named_parameters()}
            others = set()
        prefix = f"{entry['dcp']}.state."
        for key, meta in saved.items():
            if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata) or len(meta.size) == 0:
                continue
            name = key[len(prefix):].rsplit(".", 1)[0]
            param = names.get(name)
            if param is None and name in others:
                continue
            if param is None:
                problems.append(f"optimizer {i}: state for parameter {name!r}, which this run's model does not have")
            elif tuple(meta.size) != tuple(param.shape):
                problems.append(f"optimizer {i}: state {key[len(prefix):]} has shape {list(meta.size)}, the parameter "
                                f"{list(param.shape)}")
    return problems


def load(folder: str, contents: dict[str, Any], models: list[nn.Module], optimizers: list[Any],
         group: Any = None, metadata: Any = None, files: Any = None) -> None:
    """Read the shards into the live models and optimizers (after ``check`` passed everywhere);
    ``metadata``: the folder's ``read_metadata`` when the caller has it already; ``files``: the load's
    ``restorer.Reader``, which reads each shard file once and checks it against the manifest (without
    it the files are read once each, checked against their real size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from .dcp_reader import MetadataReader, WeightsOnlyPlanner

    if metadata is None:
        metadata = read_metadata(folder)
    saved = metadata.state_dict_metadata
    state = _targets(models, [], [])
    stateless = set()
    for entry, opt in zip(contents["optimizers"], optimizers):
        name = entry.get("dcp")  # None: written before parameter groups were always stored
        if not name:
            continue
        inner = getattr(opt, "optimizer", opt)
        has_state, groups = _saved_groups(saved, name)
        if _pipelined(_owner(models, inner)):
            state[name] = _stage_optimizer_target(_owner(models, inner), inner, saved, name)
        elif has_state:
            state[name] = get_optimizer_state_dict(_owner(models, inner), inner)
        else:  # only hyperparameters were stored: read them as they were saved
            state[name] = {"param_groups": [dict.fromkeys(groups[g]) for g in sorted(groups)]}
            stateless.add(name)
    from torch.distributed.checkpoint.api import CheckpointException

    from .dcp_reader import wrapped

    if files is not None:  # the bytes verified against the manifest (process 0 of a machine read them already)
        opener = functools.partial(_verified, files)
        release = lambda name, read: files.release(f"{SUBDIR}/{name}")  # noqa: E731
        reader = MetadataReader(os.path.join(folder, SUBDIR), metadata, opener, release)
    else:
        reader = MetadataReader(os.path.join(folder, SUBDIR), metadata)  # DCP gets the records read above
    try:
        # DCP gathers every rank's failure and raises the same CheckpointException on each of them.
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyPlanner(os.path.join(folder, SUBDIR)), process_group=group)
    except CheckpointException as e:
        raise wrapped(os.path.join(folder, SUBDIR), e) from None
    for i, model in enumerate(models):
        if _pipelined(model):
            model.load_stage_state_dict(state[f"model_{i}"])
        else:
            set_model_state_dict(model, state[f"model_{i}"])
    for entry, opt in zip(contents["optimizers"], optimizers):
        name = entry.get("dcp")
        inner = getattr(opt, "optimizer", opt)
        if name and _pipelined(_owner(models, inner)):
            _load_stage_optimizer_state(_owner(models, inner), inner, state[name])
        elif name in stateless:
            _load_groups(inner, state[name]["param_groups"])
        elif name:
            set_optimizer_state_dict(_owner(models, inner), inner, state[name])


def _verified(files: Any, name: str) -> Any:
    """The verified bytes of the shard file ``name`` of the DCP folder, from the load's ``restorer.Reader``:
    those it verified before the load's pre-hooks (process 0 of each machine), else read now and checked
    against the manifest's checksum whatever ``verify`` says, since nothing else checked these bytes."""
    return files.file(f"{SUBDIR}/{name}", checksum=True)


def _saved_groups(saved: dict[str, Any], name: str) -> tuple[bool, dict[int, list[str]]]:
    """Whether optimizer ``name`` was stored with state, and the keys of each of its parameter groups."""
    state_prefix, group_prefix = f"{name}.state.", f"{name}.param_groups."
    groups: dict[int, list[str]] = {}
    for key in saved:
        if key.startswith(group_prefix):
            index, _, field = key[len(group_prefix):].partition(".")
            groups.setdefault(int(index), []).append(field)
    return any(key.startswith(state_prefix) for key in saved), groups


def _load_groups(optimizer: Any, groups: list[dict[str, Any]]) -> None:
    """What ``Optimizer.load_state_dict`` does with a state dict without state: the saved
    hyperparameters, the live parameters, and no state left from before."""
    for live, stored in zip(optimizer.param_groups, groups):
        live.update({k: v for k, v in stored.items() if k != "params"})
    optimizer.state.clear()


def refuse(blocking: bool, mid_window: bool) -> None:
    """What sharded checkpoints do not support, named before anything is written."""
    if mid_window:
        raise ValueError("save_state inside a gradient-accumulation window (accelerator.sync_gradients is False): "
                         "with a sharded model (FSDP2, tensor parallel, pipeline stages) the partial gradients of the "
                         "window live in FSDP's unsharded buffers, as DTensor shards or on each stage's process, which "
                         "a checkpoint does not hold; call "
                         "save_state after the window's last micro-step (`if accelerator.sync_gradients: "
                         "accelerator.save_state()`)")


listing = files  # the backend interface's names (see checkpointing.backends)


def optimizer_entry(index: int, with_state: bool) -> Optional[str]:
    return f"optimizer_{index}" if with_state else None


def _backend(strategy: Any) -> Reader:
    return Reader()  # one per load: it reads any layout


from .backends import register  # noqa: E402

register(KEY, _backend)
