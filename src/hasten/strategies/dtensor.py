"""What FSDP2 and tensor parallelism share: a model laid out on a ``ParallelMesh`` with DTensor parameters.

Both lay the model out with the layout steps (``layout_steps``: cp, the tensor plan, activation
checkpointing, sharding) over the mesh, replace parameters with DTensor
ones (so optimizers built on the originals are re-pointed), can fill a model built on ``meta`` from
process 0's weights, clip gradients by their norm over every shard, and store checkpoints as
torch.distributed.checkpoint (DCP) shards. ``FSDP2Strategy`` adds ``fully_shard`` over the
data-parallel dimensions; ``TensorParallelStrategy`` uses the mesh as it is.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..activation_checkpointing import strip_checkpoint_prefix
from .base import Params, Strategy
from .mesh import ParallelMesh
from .sharded_state import full_state_dict, load_full_state_dict
from .layout_steps import lay_out



class DTensorStrategy(Strategy):
    """A model laid out on the mesh of ``plan.parallelism_config`` (default: every process one
    ``dp_shard``); subclasses say how the data-parallel dimensions hold it (``sharding``)."""

    checkpoint_format = "dcp"

    def __init__(self, plan: Any) -> None:
        self.parallelism_config = plan.parallelism_config
        # Keyed by the parameter objects (identity, weakly held): original parameter -> the one that replaced it;
        # float8 weight wrapper -> the parameter it replaced. Only parameters the model no longer holds are keys:
        # a tensor with a weak reference cannot be swapped (torch.utils.swap_tensors), which FSDP2's to_empty of a
        # model prepared on meta does. The models' own parameters are found through the models (``_prepared``).
        self._new_params = WeakIdKeyDictionary()
        self._fp8_replaced = WeakIdKeyDictionary()
        self._prepared: list[weakref.ref] = []  # the models laid out, weakly
        super().__init__(plan)

    # -- layout ---------------------------------------------------------------------------------
    def build_mesh(self) -> ParallelMesh:
        sizes = {"dp_shard": self.state.num_processes}
        if self.parallelism_config is not None and self.parallelism_config.total_size > 1:
            sizes = self.parallelism_config.sizes()
        ep = getattr(self.parallelism_config, "ep_size", 1) or 1  # borrowed from dp_shard: not a mesh size
        return ParallelMesh(sizes, self.state.process_index, self.state.num_processes, self.state.device.type,
                            keep=self.mesh_keeps(sizes), ep=ep)

    def mesh_keeps(self, sizes: dict[str, int]) -> tuple[str, ...]:
        """Dimensions the torch mesh holds even at size 1 (``ParallelMesh(keep=...)``)."""
        return ()

    # -- hooks of the subclasses ----------------------------------------------------------------
    def loads_from_rank0(self) -> bool:
        """Whether process 0's weights fill models the others built on ``meta`` (cpu_ram_efficient_loading)."""
        return False

    def offloads_to_cpu(self) -> bool:
        """Whether sharded parameters live in host memory."""
        return False

    def pending_grads(self) -> Any:
        """parameter -> gradient accumulated but not yet in ``.grad`` (see ``grad_norm``)."""
        return {}

    # -- the model ------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        on_meta = any(p.is_meta for p in model.parameters())
        efficient = self.loads_from_rank0()
        if on_meta and not efficient:
            raise ValueError("prepare() got a model with parameters on the meta device; set "
                             "FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True) so that process 0's "
                             "weights fill it (or, with the model on meta on every process, "
                             "hasten.load_checkpoint_in_model(prepared_model, folder) after prepare), or build the "
                             "model with real weights")
        # Process 0 on meta too: the model stays on meta, sharded, for load_checkpoint_in_model
        # to fill from a checkpoint folder (no process ever holds the whole model).
        efficient = efficient and not _rank0_on_meta(on_meta, self.state)
        full = _rank0_weights(model, self.state) if efficient else None
        before = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
        lay_out(self.layout_target(model))  # cp, the tensor plan, activation checkpointing, the engine's sharding
        if efficient:
            _fill_from_rank0(model, full, self.state, self.offloads_to_cpu())
        return self._remember_params(model, before)

    def _remember_params(self, model: nn.Module, before: dict[str, nn.Parameter]) -> nn.Module:
        """Map the parameters optimizers were built on to the DTensor ones that replaced them."""
        after = {strip_checkpoint_prefix(name): p for name, p in model.named_parameters(remove_duplicate=False)}
        self._prepared.append(weakref.ref(model))
        for name, old in before.items():
            new = after.get(strip_checkpoint_prefix(name))
            if new is not None and new is not old:
                self._new_params[old] = new
                replaced = self._fp8_replaced.pop(old, None)
                if replaced is not None:  # the optimizer may hold the weight from before fp8 conversion
                    self._new_params[replaced] = new
        return model

    def convert_fp8(self, model: nn.Module, plan: Any) -> None:
        """Convert before the layout; remember which weights torchao's float8 all-gather wrapper
        replaced, so that optimizers built on the original weights are re-pointed too."""
        before = dict(model.named_parameters(remove_duplicate=False))
        plan.convert(model)
        for name, param in model.named_parameters(remove_duplicate=False):
            old = before.get(name)
            if old is not None and old is not param:
                self._fp8_replaced[param] = old

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard and parallelize_module change the module in place

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point ``optimizer`` at the DTensor parameters that replaced the ones it was built on."""
        swapped = WeakIdKeyDictionary()
        held = {p for ref in self._prepared if ref() is not None for p in ref().parameters()}  # by identity
        for g, group in enumerate(optimizer.param_groups):
            params = []
            for p in group["params"]:
                new = p if p in held else self._new_params.get(p)
                if new is None:
                    raise ValueError(
                        f"optimizer {type(optimizer).__name__}, parameter group {g}: a parameter of shape "
                        f"{list(p.shape)} belongs to no model prepared with FSDP; pass the model to prepare() "
                        "together with its optimizer (accelerator.prepare(model, optimizer)), and build the "
                        "optimizer from that model's parameters"
                    )
                swapped[p] = new
                params.append(new)
            group["params"] = params
        if optimizer.state:
            state = {}
            for p, s in list(optimizer.state.items()):
                state[swapped.get(p, p)] = s
            optimizer.state.clear()
            optimizer.state.update(state)
        return optimizer

    # -- gradients ------------------------------------------------------------------------------
    def clip_grad_norm_(self, parameters: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_global_norm_(parameters, max_norm, norm_type)

    def grad_norm(self, parameters: Params, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the gradients this process accumulated so far, not yet reduced: what DDP's
        ``.grad`` hold on an accumulation micro-step (``pending_grads``: FSDP2's, kept beside each
        parameter until the sync step); tensor-parallel shards are added up over their ``tp``
        processes. Changes nothing."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        pending = self.pending_grads()
        grads = [pending.get(p, p.grad) for p in params]
        return local_norm(grads, norm_type, params=params)

    def clip_grad_value_(self, parameters: Params, clip_value: float) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for p in params:
            if p.grad is not None:
                _local(p.grad).clamp_(-clip_value, clip_value)

    # -- state dict I/O -------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module, everyone: bool = False) -> dict[str, torch.Tensor]:
        """The full state dict on CPU, on process 0 (everywhere with ``everyone``); others get {}.
        (Gathering a float8 all-gather weight gives the plain fp32 tensor: no fp8 subclass leaks out.)"""
        return full_state_dict(model, everyone=everyone)

    def load_model_state_dict(self, model: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        return load_full_state_dict(model, state_dict, strict=strict)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _replicas(tensor: torch.Tensor, world: int) -> int:
    """How many processes hold each element of ``tensor`` (a plain tensor: every process)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):  # DTensor's public layout, not its private _spec
        return world
    mesh, count = tensor.device_mesh, 1
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            count *= mesh.size(dim)
    return count * (world // mesh.size())


def _norm_groups(grads: list[torch.Tensor], weights: list[int]) -> dict[tuple, list[torch.Tensor]]:
    """Non-empty local shards of ``grads`` by (device, dtype, weight): one foreach kernel each."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g, weight in zip(grads, weights):
        local = _local(g).detach()
        if local.numel():  # an uneven shard can be empty; the inf norm of nothing has no identity
            groups.setdefault((local.device, local.dtype, weight), []).append(local)
    return groups


def _partial_norm(grads: list[torch.Tensor], weights: list[int], norm_type: float,
                  device: torch.device) -> torch.Tensor:
    """This process's part of the norm of ``grads`` as one fp32 scalar on ``device``: the max of the
    absolute values (inf), else the sum of ``|x| ** norm_type`` with each tensor's sum divided by its
    weight (how many processes hold it). Per-tensor norms come from ``torch._foreach_norm`` (one kernel
    per device and dtype, accumulated in fp32, no fp64 copy of the gradients)."""
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (_, dtype, weight), tensors in _norm_groups(grads, weights).items():
        # bf16/fp16: accumulate in fp32 (a norm in bf16 keeps 3 digits); fp32/fp64 as they are
        wide = torch.float32 if dtype.itemsize < 4 and dtype.is_floating_point else None
        norms = torch.stack(torch._foreach_norm(tensors, norm_type, dtype=wide)).to(device, torch.float32)
        if inf:
            total = torch.maximum(total, norms.max())
        else:
            part = norms.pow(norm_type).sum()
            total = total + (part / weight if weight != 1 else part)
    return total


def _finish(total: torch.Tensor, norm_type: float) -> torch.Tensor:
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def clip_global_norm_(parameters: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their norm over every shard and every process; returns that norm.

    Each process adds up its local shards, counting elements it shares with other processes
    (replicated placements) once over the job, so one all-reduce gives the true global norm. Every
    process takes part in exactly that one all-reduce whichever gradients it has (a parameter's
    gradient may be None on one rank only, e.g. a branch only its data reached): the number of
    collectives depends on nothing rank-local.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    if not params:  # the same on every rank: one model, one parameter list
        return torch.tensor(0.0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    grads = [p.grad for p in params if p.grad is not None]
    device = _local(params[0]).device  # not the first gradient's: that one may be missing on this rank
    total = _partial_norm(grads, [_replicas(g, world) for g in grads], norm_type, device)
    if world > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    total = _finish(total, norm_type)
    if not grads:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        local = _local(g)
        by_device.setdefault((local.device, local.dtype), []).append(local)
    for (dev, _), tensors in by_device.items():
        torch._foreach_mul_(tensors, coef.to(dev))
    return total


def _sharded_dims(tensor: Optional[torch.Tensor]) -> tuple:
    """(mesh, dimensions ``tensor`` is sharded on); (None, ()) for a plain tensor."""
    from torch.distributed.tensor import DTensor

    return (None, ()) if not isinstance(tensor, DTensor) else \
        (tensor.device_mesh, tuple(d for d, p in enumerate(tensor.placements) if p.is_shard()))


def local_norm(grads: list[Optional[torch.Tensor]], norm_type: float = 2.0,
               params: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
    """The norm of ``grads`` (None: no gradient) as this process holds them: plain tensors as they are,
    DTensors whole over the mesh dimensions they are sharded on (one all-reduce per mesh and dimension;
    replicated and partial dimensions are this process's own values).

    The all-reduces are those of the layouts of ``params`` (the parameters the gradients belong to, the
    same on every rank), not of the gradients present here, so every rank takes part in the same
    collectives even where a gradient exists on one rank only. Without ``params`` the gradients' own
    layouts are used (then the caller must pass the same layouts on every rank)."""
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    layouts = [_sharded_dims(t) for t in (params if params is not None else grads) if t is not None]
    present = [g for g in grads if g is not None]
    sample = params[0] if params else (present[0] if present else None)
    device = _local(sample).device if sample is not None else torch.device("cpu")
    keys = list(dict.fromkeys([(None, ())] + layouts))  # ordered the same on every rank
    by_key: dict[tuple, list[torch.Tensor]] = {key: [] for key in keys}
    for g in present:
        by_key.setdefault(_sharded_dims(g), []).append(g)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, dims), members in by_key.items():
        value = _partial_norm(members, [1] * len(members), norm_type, device)
        for dim in dims:
            if mesh.size(dim) > 1:
                dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, value) if inf else total + value
    return _finish(total, norm_type)


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                setattr(module, name, buffer.to(device))


def _rank0_on_meta(on_meta: bool, state: Any) -> bool:
    """Whether process 0 built its model on ``meta`` (every process learns it: one broadcast)."""
    flag = torch.tensor([int(on_meta)], device=state.device)
    if state.num_processes > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def _rank0_weights(model: nn.Module, state: Any) -> Optional[dict[str, Any]]:
    """Process 0's full weights (its state dict and non-persistent buffers), kept before sharding."""
    if state.process_index != 0:
        return None
    persistent = model.state_dict()
    extra = {n: b for n, b in model.named_buffers() if n not in persistent}
    return {"state": {k: v for k, v in persistent.items()}, "buffers": extra}


def _fill_from_rank0(model: nn.Module, full: Optional[dict[str, Any]], state: Any, offload: bool) -> None:
    """Give every process process 0's weights after sharding (the others built on ``meta``).

    With CPU offload the shards live in host memory (FSDP2 refuses offloaded parameters on the
    accelerator), buffers on the device. DCP's broadcast wants every tensor of the model on one
    device, so buffers wait on CPU with the shards and move to the device once filled.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = state.device
    home = torch.device("cpu") if offload else device
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device=home)
    if offload:
        _move_buffers(model, home)
    set_model_state_dict(model, full["state"] if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if offload:
        _move_buffers(model, device)
    persistent = set(model.state_dict().keys())
    for name, buffer in model.named_buffers():
        if strip_checkpoint_prefix(name) in persistent or name in persistent:
            continue
        if full is not None:
            buffer.copy_(full["buffers"][strip_checkpoint_prefix(name)])
        comm = buffer if device.type != "cpu" or buffer.device.type == "cpu" else buffer.cpu()
        dist.broadcast(comm, src=0)
        if comm is not buffer:
            buffer.copy_(comm)
