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
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..precision import Precision
from ..utils.dataclasses import DistributedType
from ..utils.fsdp_plugin import FullyShardedDataParallelPlugin, offloads_to_cpu
from .dtensor import DTensorStrategy
from .scaler import agreeing_scaler

_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


class ShardedPrecision(Precision):
    """Mixed precision through ``MixedPrecisionPolicy``: no autocast around forward."""

    def __init__(self, mode: str, device: torch.device, *args: Any, **kwargs: Any) -> None:
        super().__init__(mode, device, *args, **kwargs)
        self.scaler = agreeing_scaler(self.scaler, device)

    def wrap_forward(self, model: nn.Module) -> None:
        return None  # the policy casts parameters and inputs


class FSDP2Strategy(DTensorStrategy):
    """FSDP2 over the mesh's data-parallel dimensions (with tensor parallelism inside: ``dp_shard`` x ``tp``).

    Reads ``plan.fsdp_plugin`` (a ``FullyShardedDataParallelPlugin``; default from ``FSDP_*``) and
    ``plan.parallelism_config`` (mesh sizes; default: every process one shard).
    """

    distributed_type = DistributedType.FSDP

    def __init__(self, plan: Any) -> None:
        plugin = plan.fsdp_plugin
        self.plugin = plugin if isinstance(plugin, FullyShardedDataParallelPlugin) else FullyShardedDataParallelPlugin()
        self._fp8_models: list[weakref.ref] = []  # models whose weights FSDP2 all-gathers in float8
        self._fp8_hooks: list[Any] = []  # optimizer step hooks that precompute their float8 scales
        self._sharded_models: list[weakref.ref] = []  # models fully_shard changed (their micro-step gradients)
        super().__init__(plan)

    # -- layout and precision -------------------------------------------------------------------
    def mesh_keeps(self, sizes: dict[str, int]) -> tuple[str, ...]:
        # fully_shard needs a shard dimension even of size 1 (one process, tp alone, plain replication).
        return ("dp_shard",) if sizes.get("cp", 1) == 1 else ()

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
        # With context (sequence) parallelism the cp (sp) processes shard the model too (Accelerate's dp_shard_cp).
        shard = "dp_shard_cp" if sizes["cp"] > 1 else "dp_shard_sp" if sizes["sp"] > 1 else "dp_shard"
        if sizes["dp_replicate"] > 1:
            # HSDP: replicated over dp_replicate, sharded over the shard dimension. With a shard dimension
            # of size 1 every process holds the full parameters and gradients are all-reduced: replication.
            return self.mesh[("dp_replicate", shard)]
        return self.mesh[shard]

    # -- the model ------------------------------------------------------------------------------
    def loads_from_rank0(self) -> bool:
        return bool(self.plugin.cpu_ram_efficient_loading)

    def offloads_to_cpu(self) -> bool:
        return offloads_to_cpu(self.plugin.cpu_offload)

    places_model_itself = True  # fully_shard moves each module's states to the mesh's device as it shards

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = super().wrap_model(model)
        _place_unsharded(model, self.state.device)
        from ..fp8 import gathers_in_float8

        if gathers_in_float8(model):
            self._fp8_models.append(weakref.ref(model))
        return model

    def sharding(self) -> Any:
        return self.shard

    def shard(self, model: nn.Module) -> None:
        """``fully_shard`` each chosen layer, then the root, over the data-parallel dimensions (the
        ``sharding`` layout step, after the tensor plan and activation checkpointing)."""
        from torch.distributed.fsdp import fully_shard

        from .expert_parallel import fully_shard_experts

        kwargs = dict(mesh=self._shard_mesh(), reshard_after_forward=bool(self.plugin.reshard_after_forward),
                      mp_policy=self._mp_policy(), offload_policy=self._offload_policy())
        ignored = self._ignored_params(model)
        if ignored:
            kwargs["ignored_params"] = ignored
        # The experts split over ep (the expert_parallel step) first, on their own mesh (efsdp, with dp_replicate).
        experts = fully_shard_experts(model, self.mesh, **kwargs)
        layers = [m for m in self._layers(model) if m not in experts]  # after checkpointing: inside the wrappers
        for layer in layers:
            fully_shard(layer, **kwargs)
        policy = kwargs["mp_policy"]
        if policy.param_dtype is not None and policy.output_dtype is None and not self._user_policy():
            # The root hands back fp32 outputs, as autocast-based precision does, so a loss computed
            # from them is fp32 (a bf16/fp16 loss loses digits and overflows sooner when scaled).
            import dataclasses

            kwargs["mp_policy"] = dataclasses.replace(policy, output_dtype=torch.float32)
        keep_root = kwargs["reshard_after_forward"] and any(p.requires_grad for p in model.parameters())
        if keep_root:
            # The root of a trained model: torch's default (automatic since torch 2.8, before it the same for
            # the root) keeps the root's own parameters (embeddings, output head) gathered from its forward to
            # its backward, which starts with them; an explicit True frees and re-gathers them around every
            # forward. After a forward without gradients nothing follows to free them, so a hook does.
            del kwargs["reshard_after_forward"]
        fully_shard(model, **kwargs)
        if keep_root:
            model.register_forward_hook(_reshard_after_forward_without_grad)
        self._sharded_models.append(weakref.ref(model))

    def checkpoint_targets(self, model: nn.Module) -> list[nn.Module]:
        """The plugin's ``activation_checkpointing`` flag checkpoints the layers its auto-wrap policy
        picks (Accelerate's behaviour); ``ActivationCheckpointingKwargs`` the model's blocks."""
        if not self.plugin.activation_checkpointing:
            return super().checkpoint_targets(model)
        layers = self._layers(model)
        if not layers:
            raise ValueError("activation_checkpointing=True needs an auto_wrap_policy that selects layers "
                             "(TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP)")
        return layers

    def _user_policy(self) -> bool:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return isinstance(self.plugin.mixed_precision_policy, (MixedPrecisionPolicy, dict))

    def _layers(self, model: nn.Module) -> list[nn.Module]:
        """The submodules that become their own FSDP group, in post-order."""
        policy = self.plugin.auto_wrap_policy
        if policy == "NO_WRAP":
            return []
        if callable(policy):  # a checkpoint wrapper is not a layer: the module inside it is
            return [m for m in model.modules()
                    if m is not model and type(m).__name__ != "CheckpointWrapper" and policy(m)]
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

    def release(self) -> None:
        for handle in self._fp8_hooks:
            handle.remove()
        self._fp8_hooks.clear()
        self._fp8_models.clear()
        self._sharded_models.clear()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point ``optimizer`` at the sharded parameters that replaced the ones it was built on."""
        optimizer = super().prepare_optimizer(optimizer)
        self._hook_float8_scales(optimizer)
        return optimizer

    def _hook_float8_scales(self, optimizer: torch.optim.Optimizer) -> None:
        """After each step the optimizer really takes (not on accumulation micro-steps, not when
        the fp16 scaler skips it: the inner step does not run then), precompute the float8 scales
        of the models it trains, in one all-reduce, as torchao asks."""
        held = set(p for group in optimizer.param_groups for p in group["params"])  # hashed by identity
        models = [ref for ref in self._fp8_models
                  if ref() is not None and any(p in held for p in ref().parameters())]
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

    def pending_grads(self) -> Any:
        """FSDP2 keeps micro-step gradients unsharded beside each parameter until the sync step (the
        sharded ``.grad`` is still None)."""
        return _unreduced_grads([ref() for ref in self._sharded_models if ref() is not None])


def _reshard_after_forward_without_grad(module: nn.Module, args: Any, output: Any) -> None:
    """Free the root's gathered parameters after a forward no backward will follow (evaluation, ``no_grad``),
    so ``parameters()`` are the shards again and the memory is returned, as after a training step."""
    if not torch.is_grad_enabled():
        _reshard_eagerly(module)


@torch.compiler.disable
def _reshard_eagerly(module: nn.Module) -> None:
    module.reshard()  # FSDPModule.reshard: outside any compiled graph (it changes the module's parameters)


def _place_unsharded(model: nn.Module, device: torch.device) -> None:
    """Move what fully_shard left where the user built it (ignored modules' parameters and buffers) to
    ``device``, one tensor at a time. Sharded (DTensor) parameters stay where FSDP2 put them (host
    memory under CPU offload); meta tensors wait for the rank-0 fill."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not isinstance(param, DTensor) and not param.is_meta and param.device != device:
                with torch.no_grad():
                    param.data = param.data.to(device)  # same Parameter: optimizers built on it still hold it
        for name, buffer in module.named_buffers(recurse=False):
            if not buffer.is_meta and buffer.device != device:
                setattr(module, name, buffer.to(device))


def _unreduced_grads(models: list[nn.Module]) -> Any:
    """sharded parameter -> the unsharded gradient FSDP2 accumulated for it without reducing
    (``set_requires_gradient_sync(False)``), for the parameters that have one. FSDP2 offers no public
    way to read them, so this looks at its parameter groups (``FSDPParam``)."""
    from torch.distributed.fsdp import FSDPModule

    out: dict = {}  # keyed by the parameter objects (hashed by identity), for the caller to read at once
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
                        out[fp.sharded_param] = grad
            except AttributeError as e:
                raise RuntimeError(f"clip_grad_norm_ on an accumulation micro-step cannot read FSDP2's accumulated "
                                   f"gradients with torch {torch.__version__} ({e}); call it where "
                                   "accelerator.sync_gradients is True") from None
    return out


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


def check_offload_backend(device_type: str, backend: str) -> None:
    """Refuse CPU offload on a process group that cannot move CPU tensors (an accelerator's backend alone)."""
    from ..device_choice import choose_backend, serves_cpu_tensors

    if not serves_cpu_tensors(backend):
        raise ValueError(
            f"FSDP cpu_offload needs a process group that moves CPU tensors, but it was made with backend "
            f"{backend!r} (PartialState() before the Accelerator, or init_process_group by hand). Create the "
            f"Accelerator(fsdp_plugin=...) first, launch with hasten launch --use_fsdp --fsdp_offload_params true, or "
            f"init_process_group(backend={choose_backend(device_type, cpu_offload=True)!r})")
