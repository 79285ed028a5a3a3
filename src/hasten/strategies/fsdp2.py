"""Fully sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Parameters, gradients and optimizer state are sharded over the ``dp_shard`` dimension of the
mesh (HSDP: replicated over ``dp_replicate``). Parameters stay fp32 (the optimizer's master
weights); mixed precision is FSDP2's ``MixedPrecisionPolicy`` (compute in bf16/fp16, reduce in
fp32), not autocast. ``fully_shard`` replaces each module's parameters with sharded ``DTensor``
parameters, so optimizers built on the original parameters are re-pointed at the new ones; an
optimizer parameter that belongs to no prepared model is an error. Checkpoints are written as
torch.distributed.checkpoint (DCP) shards by every process.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..precision import Precision
from ..utils.dataclasses import DistributedType
from ..utils.fsdp_plugin import FullyShardedDataParallelPlugin, offloads_to_cpu
from .base import Params, Strategy
from .mesh import ParallelMesh
from .scaler import agreeing_scaler
from .sharded_state import full_state_dict, load_full_state_dict
from .tp_plan import apply_tensor_parallel

_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


class ShardedPrecision(Precision):
    """Mixed precision through ``MixedPrecisionPolicy``: no autocast around forward."""

    def __init__(self, mode: str, device: torch.device, *args: Any, **kwargs: Any) -> None:
        super().__init__(mode, device, *args, **kwargs)
        self.scaler = agreeing_scaler(self.scaler, device)

    def wrap_forward(self, model: nn.Module) -> None:
        return None  # the policy casts parameters and inputs


def _strip(name: str) -> str:
    return name.replace(_CHECKPOINT_PREFIX, "")


class FSDP2Strategy(Strategy):
    """FSDP2 over the mesh's data-parallel dimensions.

    Options: ``fsdp_plugin`` (a ``FullyShardedDataParallelPlugin``; default from ``FSDP_*``),
    ``parallelism_config`` (mesh sizes; default: every process one shard).
    """

    distributed_type = DistributedType.FSDP
    checkpoint_format = "dcp"

    def __init__(self, state: Any, fsdp_plugin: Any = None, parallelism_config: Any = None, **options: Any) -> None:
        if not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
            fsdp_plugin = FullyShardedDataParallelPlugin()
        self.plugin = fsdp_plugin
        self.parallelism_config = parallelism_config
        self._new_params: dict[int, nn.Parameter] = {}  # id(original parameter) -> sharded parameter
        self._sharded_ids: set[int] = set()
        self._fp8_replaced: dict[int, nn.Parameter] = {}  # id(float8 weight wrapper) -> the parameter it replaced
        self._fp8_models: list[weakref.ref] = []  # models whose weights FSDP2 all-gathers in float8
        self._fp8_hooks: list[Any] = []  # optimizer step hooks that precompute their float8 scales
        self._sharded_models: list[weakref.ref] = []  # models fully_shard changed (their micro-step gradients)
        super().__init__(state, **options)

    # -- layout and precision -------------------------------------------------------------------
    def build_mesh(self) -> ParallelMesh:
        sizes = {"dp_shard": self.state.num_processes}
        if self.parallelism_config is not None and self.parallelism_config.total_size > 1:
            sizes = self.parallelism_config.sizes()
        # fully_shard needs a shard dimension even of size 1 (one process, tp alone, plain replication).
        keep = ("dp_shard",) if self.shards_data_parallel() and sizes.get("cp", 1) == 1 else ()
        return ParallelMesh(sizes, self.state.process_index, self.state.num_processes, self.state.device.type,
                            keep=keep)

    def build_precision(self, mode: str, scaler_kwargs: Any, autocast_kwargs: Any) -> Precision:
        if mode == "fp8" and self.mesh.sizes["tp"] > 1:
            raise NotImplementedError("mixed_precision='fp8' with tensor parallelism (tp_size > 1) is not supported; "
                                      "use fp8 with FSDP2 alone (tp_size=1), or mixed_precision='bf16'")
        # fp8: the float8 layers cast their weights and inputs themselves; the rest runs in bf16
        # through the policy (as "bf16"), with fp32 master weights and gradient reduction.
        return ShardedPrecision(mode, self.state.device, scaler_kwargs, autocast_kwargs)

    def _mp_policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = self.plugin.mixed_precision_policy
        if isinstance(policy, MixedPrecisionPolicy):
            return policy
        if isinstance(policy, dict):
            return MixedPrecisionPolicy(**{k: _LOW.get(v, v) if isinstance(v, str) else v for k, v in policy.items()})
        mode = policy if isinstance(policy, str) else self.precision.mode
        mode = "bf16" if mode == "fp8" else mode
        if mode in _LOW:
            return MixedPrecisionPolicy(param_dtype=_LOW[mode], reduce_dtype=torch.float32)
        if mode not in ("no", "fp32", None):
            raise ValueError(f"mixed_precision_policy={policy!r}; use 'bf16', 'fp16', a dict or a MixedPrecisionPolicy")
        return MixedPrecisionPolicy()

    def _offload_policy(self) -> Any:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        offload = self.plugin.cpu_offload
        if isinstance(offload, OffloadPolicy):
            return offload
        if not offload:
            return OffloadPolicy()
        check_offload_backend(self.state.device.type, dist.get_backend_config())
        # Pinned host memory needs an accelerator; without one pinning fails.
        return CPUOffloadPolicy(pin_memory=self.state.device.type != "cpu")

    def _shard_mesh(self) -> Any:
        sizes = self.mesh.sizes
        # With context parallelism the cp processes shard the model too (Accelerate's dp_shard_cp).
        shard = "dp_shard_cp" if sizes["cp"] > 1 else "dp_shard"
        if sizes["dp_replicate"] > 1:
            # HSDP: replicated over dp_replicate, sharded over the shard dimension. With a shard dimension
            # of size 1 every process holds the full parameters and gradients are all-reduced: replication.
            return self.mesh[("dp_replicate", shard)]
        return self.mesh[shard]

    # -- the model ------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        on_meta = any(p.is_meta for p in model.parameters())
        efficient = self.plugin.cpu_ram_efficient_loading
        if on_meta and not efficient:
            raise ValueError("prepare() got a model with parameters on the meta device; set "
                             "FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True) so that process 0's "
                             "weights fill it, or build the model with real weights")
        full = _rank0_weights(model, self.state) if efficient else None
        before = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
        if self.mesh.sizes["cp"] > 1:
            from .context_parallel import prepare_model

            prepare_model(model, getattr(self.parallelism_config, "cp_handler", None))
        if self.mesh.sizes["tp"] > 1:
            apply_tensor_parallel(model, self.mesh["tp"], getattr(self.parallelism_config, "tp_plan", None))
        if self.shards_data_parallel():
            self._fully_shard(model)
        if efficient:
            offload = offloads_to_cpu(self.plugin.cpu_offload) and self.shards_data_parallel()
            _fill_from_rank0(model, full, self.state, offload)
        from ..fp8 import gathers_in_float8

        if gathers_in_float8(model):
            self._fp8_models.append(weakref.ref(model))
        return self._remember_params(model, before)

    def _fully_shard(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard

        layers = self._layers(model)
        if self.plugin.activation_checkpointing:
            if not layers:
                raise ValueError("activation_checkpointing=True needs an auto_wrap_policy that selects layers "
                                 "(TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP)")
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

            chosen = {id(m) for m in layers}
            apply_activation_checkpointing(model, check_fn=lambda m: id(m) in chosen)
        kwargs = dict(mesh=self._shard_mesh(), reshard_after_forward=bool(self.plugin.reshard_after_forward),
                      mp_policy=self._mp_policy(), offload_policy=self._offload_policy())
        ignored = self._ignored_params(model)
        if ignored:
            kwargs["ignored_params"] = ignored
        for layer in layers:
            fully_shard(layer, **kwargs)
        policy = kwargs["mp_policy"]
        if policy.param_dtype is not None and policy.output_dtype is None and not self._user_policy():
            # The root hands back fp32 outputs, as autocast-based precision does, so a loss computed
            # from them is fp32 (a bf16/fp16 loss loses digits and overflows sooner when scaled).
            import dataclasses

            kwargs["mp_policy"] = dataclasses.replace(policy, output_dtype=torch.float32)
        fully_shard(model, **kwargs)
        self._sharded_models.append(weakref.ref(model))

    def _user_policy(self) -> bool:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return isinstance(self.plugin.mixed_precision_policy, (MixedPrecisionPolicy, dict))

    def shards_data_parallel(self) -> bool:
        """Whether ``fully_shard`` runs over the data-parallel dimensions (FSDP2: yes)."""
        return True

    def _remember_params(self, model: nn.Module, before: dict[str, nn.Parameter]) -> nn.Module:
        """Map the parameters optimizers were built on to the sharded ones that replaced them."""
        after = {_strip(name): p for name, p in model.named_parameters(remove_duplicate=False)}
        for name, old in before.items():
            new = after.get(_strip(name))
            if new is not None:
                self._new_params[id(old)] = new
                self._sharded_ids.add(id(new))
                replaced = self._fp8_replaced.pop(id(old), None)
                if replaced is not None:  # the optimizer may hold the weight from before fp8 conversion
                    self._new_params[id(replaced)] = new
        return model

    def convert_fp8(self, model: nn.Module, plan: Any) -> None:
        """Convert before sharding; remember which weights torchao's float8 all-gather wrapper
        replaced, so that optimizers built on the original weights are re-pointed too."""
        before = dict(model.named_parameters(remove_duplicate=False))
        plan.convert(model)
        for name, param in model.named_parameters(remove_duplicate=False):
            old = before.get(name)
            if old is not None and old is not param:
                self._fp8_replaced[id(param)] = old

    def _layers(self, model: nn.Module) -> list[nn.Module]:
        """The submodules that become their own FSDP group, in post-order."""
        policy = self.plugin.auto_wrap_policy
        if policy == "NO_WRAP":
            return []
        if callable(policy):
            return [m for m in model.modules() if m is not model and policy(m)]
        if policy == "TRANSFORMER_BASED_WRAP":
            names = self.plugin.transformer_cls_names_to_wrap or list(getattr(model, "_no_split_modules", None) or [])
            if not names:
                raise ValueError("auto_wrap_policy=TRANSFORMER_BASED_WRAP needs transformer_cls_names_to_wrap "
                                 "(fsdp_transformer_layer_cls_to_wrap), e.g. 'LlamaDecoderLayer'; this model has no "
                                 "_no_split_modules to take them from")
            present = {type(m).__name__ for m in model.modules()}
            missing = [n for n in names if n not in present]
            if missing:
                raise ValueError(f"transformer_cls_names_to_wrap names {missing}, which are not classes of modules in "
                                 f"{type(model).__name__}; pick from {sorted(present)[:20]}")
            return [m for m in model.modules() if m is not model and type(m).__name__ in names]
        return _size_based(model, self.plugin.min_num_params)

    def _ignored_params(self, model: nn.Module) -> set:
        spec = self.plugin.ignored_modules
        if not spec:
            return set()
        if isinstance(spec, str):
            import re

            modules = [m for n, m in model.named_modules() if re.fullmatch(spec, n)]
        else:
            modules = list(spec)
        return {p for m in modules for p in m.parameters()}

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard changes the module in place

    def release(self) -> None:
        for handle in self._fp8_hooks:
            handle.remove()
        self._fp8_hooks.clear()
        self._fp8_models.clear()
        self._sharded_models.clear()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point ``optimizer`` at the sharded parameters that replaced the ones it was built on."""
        optimizer = self._repoint(optimizer)
        self._hook_float8_scales(optimizer)
        return optimizer

    def _hook_float8_scales(self, optimizer: torch.optim.Optimizer) -> None:
        """After each step the optimizer really takes (not on accumulation micro-steps, not when
        the fp16 scaler skips it: the inner step does not run then), precompute the float8 scales
        of the models it trains, in one all-reduce, as torchao asks."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        models = [ref for ref in self._fp8_models
                  if ref() is not None and any(id(p) in held for p in ref().parameters())]
        if not models:
            return
        from ..fp8 import precompute_float8_scales

        def precompute(*_: Any) -> None:
            for ref in models:
                model = ref()
                if model is not None:
                    precompute_float8_scales(model)

        self._fp8_hooks.append(optimizer.register_step_post_hook(precompute))

    def weights_loaded(self, models: list[nn.Module]) -> None:
        from ..fp8 import gathers_in_float8, precompute_float8_scales

        for model in models:
            if gathers_in_float8(model):  # the scales of the old weights no longer fit
                precompute_float8_scales(model)

    def _repoint(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        swapped: dict[int, nn.Parameter] = {}
        for g, group in enumerate(optimizer.param_groups):
            params = []
            for p in group["params"]:
                if id(p) in self._sharded_ids:
                    params.append(p)
                    continue
                new = self._new_params.get(id(p))
                if new is None:
                    raise ValueError(
                        f"optimizer {type(optimizer).__name__}, parameter group {g}: a parameter of shape "
                        f"{list(p.shape)} belongs to no model prepared with FSDP; pass the model to prepare() "
                        "together with its optimizer (accelerator.prepare(model, optimizer)), and build the "
                        "optimizer from that model's parameters"
                    )
                swapped[id(p)] = new
                params.append(new)
            group["params"] = params
        if optimizer.state:
            state = {}
            for p, s in list(optimizer.state.items()):
                state[swapped.get(id(p), p)] = s
            optimizer.state.clear()
            optimizer.state.update(state)
        return optimizer

    # -- a training step ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _sync_off(self, model: nn.Module) -> Iterator[None]:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self._sync_off(model)

    def clip_grad_norm_(self, parameters: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_global_norm_(parameters, max_norm, norm_type)

    def grad_norm(self, parameters: Params, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the gradients this process accumulated so far, not yet reduced: what DDP's
        ``.grad`` hold on an accumulation micro-step. FSDP2 keeps them unsharded beside each
        parameter until the sync step (the sharded ``.grad`` is still None); tensor-parallel
        shards are added up over their ``tp`` processes. Changes nothing."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        pending = _unreduced_grads([ref() for ref in self._sharded_models if ref() is not None])
        grads = [pending.get(id(p), p.grad) for p in params]
        return local_norm([g for g in grads if g is not None], norm_type)

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
    spec = getattr(tensor, "_spec", None)
    if spec is None:
        return world
    count = 1
    for dim, placement in enumerate(spec.placements):
        if placement.is_replicate():
            count *= spec.mesh.size(dim)
    return count * (world // spec.mesh.size())


def clip_global_norm_(parameters: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their norm over every shard and every process; returns that norm.

    Each process adds up its local shards, counting elements it shares with other processes
    (replicated placements) once over the job, so one all-reduce gives the true global norm.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = _local(grads[0]).device if grads else torch.device("cpu")
    if not grads:
        return torch.tensor(0.0, device=device)
    if math.isinf(norm_type):
        total = torch.stack([_local(g).detach().abs().max().float() if _local(g).numel() else
                             torch.tensor(0.0, device=device) for g in grads]).max()
        if world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            local = _local(g).detach()
            if local.numel():
                part = torch.linalg.vector_norm(local.double(), norm_type) ** norm_type
                total += part / _replicas(g, world)
        if world > 1:
            dist.all_reduce(total)
        total = (total ** (1.0 / norm_type)).float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = _local(g)
        local.mul_(coef.to(local.device, local.dtype))
    return total


def _unreduced_grads(models: list[nn.Module]) -> dict[int, torch.Tensor]:
    """id(sharded parameter) -> the unsharded gradient FSDP2 accumulated for it without reducing
    (``set_requires_gradient_sync(False)``), for the parameters that have one. FSDP2 offers no public
    way to read them, so this looks at its parameter groups (``FSDPParam``)."""
    from torch.distributed.fsdp import FSDPModule

    out: dict[int, torch.Tensor] = {}
    for model in models:
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            try:
                group = module._get_fsdp_state()._fsdp_param_group
                fsdp_params = group.fsdp_params if group is not None else []
                for fp in fsdp_params:
                    # bf16/fp16 compute: accumulated in the reduce dtype beside the parameter; else in its .grad.
                    grad = fp.unsharded_accumulated_grad
                    if grad is None and hasattr(fp, "_unsharded_param"):
                        grad = fp._unsharded_param.grad
                    if grad is not None:
                        out[id(fp.sharded_param)] = grad
            except AttributeError as e:
                raise RuntimeError(f"clip_grad_norm_ on an accumulation micro-step cannot read FSDP2's accumulated "
                                   f"gradients with torch {torch.__version__} ({e}); call it where "
                                   "accelerator.sync_gradients is True") from None
    return out


def local_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of ``grads`` as this process holds them: plain tensors as they are, DTensors whole
    over the mesh dimensions they are sharded on (one all-reduce per mesh and dimension; replicated
    and partial dimensions are this process's own values)."""
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    device = _local(grads[0]).device if grads else torch.device("cpu")
    parts: dict[tuple, torch.Tensor] = {}  # (mesh, sharded dims) -> this process's sum (or max)
    for g in grads:
        local = _local(g).detach()
        spec = getattr(g, "_spec", None)
        key = (None, ()) if spec is None else \
            (spec.mesh, tuple(d for d, p in enumerate(spec.placements) if p.is_shard()))
        if inf:
            value = local.abs().max().double() if local.numel() else torch.zeros((), dtype=torch.float64, device=device)
        else:
            value = torch.linalg.vector_norm(local.double(), norm_type) ** norm_type
        parts[key] = torch.maximum(parts[key], value) if inf and key in parts else parts.get(key, 0) + value
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (mesh, dims), value in parts.items():
        value = value.to(device)
        for dim in dims:
            if mesh.size(dim) > 1:
                dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, value) if inf else total + value
    return (total if inf else total ** (1.0 / norm_type)).float()


def _size_based(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Post-order submodules holding at least ``min_params`` parameters not already in a chosen child."""
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        free = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            free += visit(child)
        if module is not model and min_params > 0 and free >= min_params:
            chosen.append(module)
            return 0
        return free

    visit(model)
    return chosen


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                setattr(module, name, buffer.to(device))


def check_offload_backend(device_type: str, backend: str) -> None:
    """Refuse CPU offload on a process group that cannot move CPU tensors (an accelerator's backend alone)."""
    from ..state import choose_backend, serves_cpu_tensors

    if not serves_cpu_tensors(backend):
        raise ValueError(
            f"FSDP cpu_offload needs a process group that moves CPU tensors, but it was made with backend "
            f"{backend!r} (PartialState() before the Accelerator, or init_process_group by hand). Create the "
            f"Accelerator(fsdp_plugin=...) first, launch with hasten launch --use_fsdp --fsdp_offload_params true, or "
            f"init_process_group(backend={choose_backend(device_type, cpu_offload=True)!r})")


def _rank0_weights(model: nn.Module, state: Any) -> Optional[dict[str, Any]]:
    """Process 0's full weights (its state dict and non-persistent buffers), kept before sharding."""
    if state.process_index != 0:
        return None
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("cpu_ram_efficient_loading=True: process 0 must build the model with real weights (only the "
                         "other processes use init_empty_weights())")
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
        if _strip(name) in persistent or name in persistent:
            continue
        if full is not None:
            buffer.copy_(full["buffers"][_strip(name)])
        comm = buffer if device.type != "cpu" or buffer.device.type == "cpu" else buffer.cpu()
        dist.broadcast(comm, src=0)
        if comm is not buffer:
            buffer.copy_(comm)

