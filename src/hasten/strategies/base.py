"""The interface every parallel strategy implements.

A strategy decides how a model is spread over processes: the process layout (``mesh``), the
precision machinery (``precision``), wrapping models and re-pointing optimizers at the wrapped
parameters, skipping gradient sync on accumulation steps, clipping, state dicts, and how a
checkpoint stores models and optimizers (``checkpoint_backend``). Data loading and checkpointing
talk to this interface only, so adding FSDP2 or DeepSpeed adds a module here and touches nothing
else.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from ..precision import Precision
from ..prepared import PrepareCall
from ..state import PartialState
from ..utils.dataclasses import AutocastKwargs, DistributedType, GradScalerKwargs
from .layout_steps import Target, lay_out
from .mesh import ParallelMesh

Params = Union[torch.Tensor, Iterable[torch.Tensor]]


def foreign_wrapper(model: nn.Module) -> Optional[str]:
    """The name of a parallel wrapper already around ``model``, if any (by class, no imports)."""
    names = {cls.__name__ for cls in type(model).__mro__}
    for name in ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel",
                 "DeepSpeedEngine", "PipelineEngine"):
        if name in names:
            return name
    return None


def user_sharded(model: nn.Module) -> Optional[str]:
    """How the user already sharded ``model`` himself (``fully_shard`` / DTensor parameters), if he did."""
    if any("FSDPModule" in {c.__name__ for c in type(m).__mro__} for m in model.modules()):
        return "fully_shard"
    if any("DTensor" in {c.__name__ for c in type(p).__mro__} for p in model.parameters()):
        return "parallelize_module"
    return None


class Strategy:
    """Single-process behaviour; subclasses override what differs.

    Args:
        plan: the run's ``hasten.planning.Plan``: the process state (device, ranks), the precision
            ("no", "fp16", "bf16", "fp8"), the kwargs handlers (fp16 scaler, autocast, DDP) and the
            engine settings each strategy reads.
    """

    distributed_type = DistributedType.NO
    #: "full": each model/optimizer as one safetensors file written by one process (today's layout);
    #: "dcp": torch.distributed.checkpoint shards written by every process.
    checkpoint_format = "full"

    def __init__(self, plan: Any) -> None:
        self.state: PartialState = plan.state
        # ActivationCheckpointingKwargs (or None): applied to each trained model's blocks in wrap_model
        self.activation_checkpointing = getattr(plan, "activation_checkpointing", None)
        self.parallelism_config = getattr(plan, "parallelism_config", None)
        self.mesh = self.build_mesh()
        self.precision = self.build_precision(plan.mixed_precision, plan.handler(GradScalerKwargs),
                                              plan.handler(AutocastKwargs))

    def build_mesh(self) -> ParallelMesh:
        """The process layout; every process is a full replica unless a subclass says otherwise, or
        sequence parallelism splits sequences over some of them (DDP then averages over dp x sp)."""
        config = self.parallelism_config
        if config is not None and config.sp_size > 1:
            return ParallelMesh(config.sizes(), self.state.process_index, self.state.num_processes,
                                self.state.device.type)
        return ParallelMesh.replicated(self.state)

    def build_precision(self, mode: str, scaler_kwargs: Optional[GradScalerKwargs],
                        autocast_kwargs: Optional[AutocastKwargs]) -> Precision:
        """Autocast + GradScaler (single process and DDP)."""
        return Precision(mode, self.state.device, scaler_kwargs, autocast_kwargs)

    def describe(self) -> dict[str, Any]:
        """What a checkpoint records about the layout it was written with."""
        # without a pipeline (sequence parallelism), the record a checkpoint had before the pp (sp) axis existed
        mesh = {name: size for name, size in self.mesh.shape.items() if name not in ("pp", "sp") or size > 1}
        if getattr(self.mesh, "ep", 1) > 1:  # borrowed from dp_shard; recorded only when the experts were split
            mesh["ep"] = self.mesh.ep
        return {"strategy": type(self).__name__, "mesh": mesh, "state_dict": self.checkpoint_format}

    def checkpoint_backend(self) -> Any:
        """How ``save_state`` stores models and optimizers: None for one full safetensors file each
        (written by process 0), else a backend (``hasten.checkpointing.backends``); "dcp" strategies
        (FSDP2, TP, models the user sharded) write torch.distributed.checkpoint shards."""
        if self.checkpoint_format == "dcp":
            from ..checkpointing import sharded

            return sharded
        return None

    def release(self) -> None:
        """Drop what the strategy holds of prepared objects (``Accelerator.free_memory``)."""

    # -- prepare --------------------------------------------------------------------------------
    def check_prepare_arguments(self, objects: tuple) -> None:
        """Refuse what this strategy cannot prepare before anything is prepared: here the
        placeholders of a DeepSpeed config (``DummyOptim``/``DummyScheduler``), which only DeepSpeed replaces."""
        from ..utils.deepspeed import check_not_dummy

        check_not_dummy(objects, self.state.distributed_type)  # after a state reset: Accelerate's error, first

    def prepare(self, call: PrepareCall) -> dict[int, Any]:
        """Prepare the models, dataloaders and optimizers of one ``Accelerator.prepare`` call (its
        schedulers come after); returns ``{argument position: prepared}``, a value
        ``call.one_by_one`` returned or a ``Built`` the Accelerator records. Default: each model,
        then each dataloader, then each optimizer (which may need the wrapped model), one by one."""
        out: dict[int, Any] = {}
        for kind in (nn.Module, torch.utils.data.DataLoader, torch.optim.Optimizer):
            for position, obj, device_placement in call.items:
                if isinstance(obj, kind):
                    out[position] = call.one_by_one(obj, device_placement)
        return out

    # -- the model ------------------------------------------------------------------------------
    # Whether ``wrap_model`` puts the model on the device itself, so ``prepare`` must not move it whole
    # first (FSDP2: fully_shard moves one module's states at a time; a whole-model move would need
    # the full model in GPU memory, the very thing CPU offload and cpu_ram_efficient_loading avoid).
    places_model_itself = False

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Return the model as it should be trained (``model`` is already on the device, unless
        ``places_model_itself``): here the layout steps it needs, and no engine."""
        lay_out(self.layout_target(model))
        return model

    def layout_target(self, module: nn.Module, whole: Optional[nn.Module] = None) -> Target:
        """``module`` (``whole``, or a pipeline stage cut from ``whole``) as the layout steps see it
        (``layout_steps``): this strategy's mesh and config, its activation checkpointing where the
        module is trained, and its engine's sharding."""
        setting = self.activation_checkpointing
        checkpoint = self.checkpoint_activations if setting is not None and any(
            p.requires_grad for p in module.parameters()) else None
        return Target(module, self.mesh, getattr(self, "parallelism_config", None), whole if whole is not None else module,
                      checkpoint=checkpoint, shard=self.sharding())

    def sharding(self) -> Optional[Callable[[nn.Module], None]]:
        """The engine's sharding step (FSDP2's ``fully_shard`` per block, then the root); None: none."""
        return None

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever ``wrap_model`` returned."""
        return model

    def checkpoint_activations(self, model: nn.Module) -> None:
        """Wrap ``model``'s blocks for activation checkpointing, in place, as the plan says: the
        ``activation_checkpointing`` layout step (``layout_target`` gives it only for a trained
        module: no backward, nothing to save for)."""
        setting = self.activation_checkpointing
        from ..activation_checkpointing import checkpoint_blocks

        checkpoint_blocks(model, self.checkpoint_targets(model), setting.mode, setting.every, setting.offload)

    def checkpoint_targets(self, model: nn.Module) -> list[nn.Module]:
        """The blocks of ``model`` that activation checkpointing applies to (``find_blocks``)."""
        from ..activation_checkpointing import find_blocks

        return find_blocks(model, self.activation_checkpointing.block_classes)

    def keeps_user_sharding(self, model: nn.Module) -> bool:
        """Whether the user sharded ``model`` himself (``user_sharded``): it is then kept as it is,
        and checkpoints store it as torch.distributed.checkpoint shards."""
        if user_sharded(model) is None:
            return False
        self.checkpoint_format = "dcp"
        return True

    def convert_fp8(self, model: nn.Module, plan: Any) -> None:
        """Swap ``model``'s chosen layers for float8 ones (``hasten.fp8.Float8Plan``), before ``wrap_model``."""
        plan.convert(model)

    def weights_loaded(self, models: list[nn.Module]) -> None:
        """Hook run on every process after ``load_state`` changed the weights of ``models``."""

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Hook for strategies that must rebuild the optimizer around sharded parameters."""
        return optimizer

    # -- a training step ------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, accumulation_steps: int = 1, **kwargs: Any) -> None:
        """Backward of one micro-step: the loss divided by the accumulation steps (its share of the
        update) and scaled for fp16."""
        if accumulation_steps > 1:
            loss = loss / accumulation_steps
        self.precision.scale_loss(loss).backward(**kwargs)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which backward does not synchronise gradients across processes."""
        return contextlib.nullcontext()

    # Whether torch's Join (``Accelerator.join_uneven_inputs``) works with this strategy's models.
    supports_join = False

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which backward synchronises gradients, even inside ``no_sync``."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, parameters: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def grad_norm(self, parameters: Params, norm_type: float = 2.0) -> torch.Tensor:
        """The total norm of the gradients of ``parameters`` as they are now, changing nothing."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        grads = [p.grad for p in params if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Params, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- state dict I/O -------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module, everyone: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict of the unwrapped model (every process gets it; a model the user
        sharded himself: process 0 only, unless ``everyone``)."""
        from .sharded_state import full_state_dict

        return full_state_dict(self.unwrap_model(model), everyone=everyone)

    def load_model_state_dict(self, model: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load a full state dict (held by every process) into the model, sharded or not."""
        from .sharded_state import load_full_state_dict

        return load_full_state_dict(self.unwrap_model(model), state_dict, strict=strict)

    def write_full_weights(self, model: nn.Module, directory: str, max_shard_size: Union[int, str],
                           main: bool) -> bool:
        """``save_model`` of a sharded model: gather and write one file at a time, never the whole
        model at once; False when ``model`` is not sharded, and the caller writes its state dict."""
        from .sharded_state import is_sharded, save_full_streamed

        if self.checkpoint_format != "dcp" or not is_sharded(model):
            return False
        save_full_streamed(model, directory, max_shard_size, main)
        return True

    def loads_full_weights_in_place(self, model: nn.Module) -> bool:
        """Whether a full state dict loads into the unwrapped ``model`` as ``Module.load_state_dict``
        would (no sharding, no engine of the strategy's own), so ``load_state`` may read the file
        straight into the model's tensors instead."""
        from .sharded_state import is_sharded

        return type(self).load_model_state_dict is Strategy.load_model_state_dict and not is_sharded(model)

    def saved_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: Any) -> Any:
        """A full, numbered optimizer state from a checkpoint file, numbered as ``optimizer`` holds
        its parameters in this run (unchanged here; a pipeline keeps its stages' part)."""
        return saved

    def load_full_optimizer_state(self, model: Optional[nn.Module], optimizer: torch.optim.Optimizer,
                                  saved: dict[str, Any]) -> bool:
        """Load a full (numbered) optimizer state into ``optimizer`` of the sharded ``model``; False
        when ``model`` is not sharded, and the caller loads the state as it is."""
        from .sharded_state import is_sharded, load_full_optimizer_state

        if model is None or not is_sharded(model):
            return False
        load_full_optimizer_state(model, optimizer, saved)
        return True
