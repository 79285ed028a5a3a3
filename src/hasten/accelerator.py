"""``Accelerator``: the thin facade a training script talks to.

It owns no mechanism of its own: process state (``state``), precision (``precision``), the parallel
strategy (``strategies``), data sharding (``data_loader``), collectives (``utils.operations``) and
saving (``saving``) each live in their own module; this class wires them together under
Accelerate's public names.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from . import progress
from .accelerator_checks import refuse_offloaded_quantized_model
from .checkpointing import CheckpointMixin
from .checkpointing.prehooks import CheckpointSession
from .compilation import compile_regions, has_repeated_blocks
from .optimizer import AcceleratedOptimizer, lomo_backward, optimizers_owning
from .options import UNSET
from .parallelism import ParallelLayoutMixin
from .planning import make_plan
from .precision import Precision
from .prepared import Built, PrepareCall, PreparedObjects
from .process_control import ProcessControlMixin
from .scheduler import AcceleratedScheduler
from .group_lifetime import quiesce_gloo_workers
from .state import warn_once
from .strategies import build_strategy, foreign_wrapper
from .tracking.mixin import TrackingMixin
from .views import SettingsViewsMixin
from .utils.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from .utils.imports import is_bitsandbytes_multi_backend_available, is_xpu_available
from .utils.other import unwrap_compiled
from .warning_kinds import HastenWarning


class Accelerator(SettingsViewsMixin, CheckpointMixin, ProcessControlMixin, TrackingMixin, ParallelLayoutMixin):
    """Adapts a plain PyTorch training loop to the current hardware and number of processes.

    The arguments keep Accelerate's names, order and defaults (hasten's own, ``resume``, are
    keyword-only). Settings left at their default are read from ``HASTEN_*`` (else
    ``ACCELERATE_*``) environment variables set by ``hasten launch``.

    Args:
        device_placement: move prepared models and batches to ``accelerator.device``.
        split_batches: deprecated, use ``DataLoaderConfiguration(split_batches=...)``.
        mixed_precision: "no", "fp16", "bf16" or "fp8" (torchao; see ``AORecipeKwargs``).
        gradient_accumulation_steps: micro-steps per optimizer step (>= 1).
        cpu: force the CPU even when an accelerator is present.
        dataloader_config: how prepared dataloaders shard data (``DataLoaderConfiguration``).
        rng_types: RNGs synchronised at the start of each epoch of a prepared dataloader.
        log_with: experiment trackers: "all" (the installed ones), a name ("tensorboard", "wandb",
            "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio"), a ``LoggerType``,
            a ``GeneralTracker`` instance, or a list of these (see ``hasten.tracking``).
        project_dir / project_config: where checkpoints and logs go.
        gradient_accumulation_plugin: full control of accumulation (exclusive with the steps argument).
        step_scheduler_with_optimizer: step prepared schedulers only when the optimizer really steps.
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``,
            ``InitProcessGroupKwargs``, ``AutocastKwargs``, ``ProfileKwargs``, one fp8 recipe
            (``AORecipeKwargs``, ...).
        dynamo_backend / dynamo_plugin: ``torch.compile`` prepared models.
        deepspeed_plugin(s) / fsdp_plugin: sharded training.
        parallelism_config: the N-D layout (``hasten.utils.ParallelismConfig``: data, tensor parallel
            sizes); default from ``PARALLELISM_CONFIG_*`` (``hasten launch --parallelism_config_*``).
        torch_tp_plugin: Accelerate's older tensor-parallel switch, turned into ``ParallelismConfig(tp_size=...)``.
        megatron_lm_plugin: Accelerate's ``MegatronLMPlugin``, mapped onto ``ParallelismConfig`` (``tp_degree`` ->
            ``tp_size``, ``pp_degree`` -> ``pp_size``, ``num_micro_batches`` -> ``pp_microbatches``); what only
            Megatron's engine does (its datasets, train step, optimizer) is refused naming the native option.
        resume: ``None``, ``"auto"``, ``"auto-skip-damaged"`` (passes over checkpoints that no longer load,
            down to a fresh start) or a checkpoint folder to resume from (see docs/checkpoints.md).
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = UNSET,  # type: ignore[assignment] - deprecated: DataLoaderConfiguration
        mixed_precision: Optional[str] = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: Optional[DataLoaderConfiguration] = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: Optional[Sequence[str]] = None,
        log_with: Any = None,
        project_dir: Optional[str] = None,
        project_config: Optional[ProjectConfiguration] = None,
        gradient_accumulation_plugin: Optional[GradientAccumulationPlugin] = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Optional[Sequence[Any]] = None,
        dynamo_backend: Optional[str] = None,
        dynamo_plugin: Optional[TorchDynamoPlugin] = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
        *,
        resume: Any = None,
        **legacy: Any,
    ) -> None:
        # Every decision the configuration implies, made once (hasten.planning); the rest reads it.
        self.plan = make_plan(
            mixed_precision, cpu, gradient_accumulation_steps, gradient_accumulation_plugin, deepspeed_plugin,
            fsdp_plugin, torch_tp_plugin, megatron_lm_plugin, parallelism_config, dynamo_backend, dynamo_plugin,
            kwargs_handlers, dataloader_config, split_batches=split_batches, deepspeed_plugins=deepspeed_plugins,
            legacy=legacy,
        )
        self.state = self.plan.state
        self.gradient_state = self.plan.gradient_state
        self.fp8 = self.plan.fp8
        self._parallelism_config = self.plan.parallelism_config
        # The strategy owns the process layout and the precision machinery (autocast + scaler, or FSDP2's policy).
        self.strategy = build_strategy(self.plan)
        self.precision = self.strategy.precision
        # Readable as accelerator.state.parallel_mesh: the view the data layer's public functions fall
        # back to when called without one (the facade passes the strategy's data-parallel view itself).
        self.state.parallel_mesh = self.strategy.mesh
        if self.device.type == "cuda" and self.num_processes > 1:  # the straggler check: GPU time, not host queueing
            progress.time_device_work(_recorded_cuda_event)
        self.device_placement = device_placement
        self.dataloader_config = self.plan.dataloader_config
        self.rng_types = list(rng_types) if rng_types is not None else ["generator"]
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.project_configuration = project_config or ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)
        self.profile_handler: Optional[ProfileKwargs] = self.plan.handler(ProfileKwargs)
        self._select_trackers(log_with)
        self.step = 0  # micro-steps inside the current accumulation window
        # What prepare() handed out (a checkpoint saves exactly these, in order), and input -> output.
        self._prepared = PreparedObjects()
        self.flag_tensor: Optional[torch.Tensor] = None
        self._auto_resume: Optional[Any] = None  # checkpointing.resume.AutoResume, set by the resume setter
        self._checkpoints = CheckpointSession()  # save/load pre-hooks, the background saver (not pickled)
        self.resume = resume  # None, "auto" or a checkpoint folder (see hasten.checkpointing.resume)

    # -- prepare --------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Optional[Sequence[Optional[bool]]] = None) -> Any:
        """Prepare models, optimizers, schedulers and dataloaders; returns them in the order given.

        Models and dataloaders are prepared first, then optimizers (which may need the wrapped
        model), then schedulers (which follow the prepared optimizers). Anything else is returned
        unchanged. Preparing an already prepared object returns it as is.
        """
        self.strategy.check_prepare_arguments(args)
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(
                f"device_placement has {len(device_placement)} entries for {len(args)} objects; give one per object"
            )
        result = list(args)
        fresh = []
        for i, obj in enumerate(args):
            done = self._already(obj)
            if done is not None:
                result[i] = done
            else:
                fresh.append(i)
        # The strategy orders models, dataloaders and optimizers (DeepSpeed sizes its engine from the dataloaders).
        items = [(i, args[i], device_placement[i]) for i in fresh]
        call = PrepareCall(items, self._prepare_one, self._dataloaders, self.gradient_accumulation_steps)
        for i, prepared in self.strategy.prepare(call).items():
            result[i] = self._prepared.record(prepared) if isinstance(prepared, Built) else prepared
        for i, obj, placement in items:  # left by the strategy: dataloaders; schedulers follow the optimizers above
            if result[i] is obj and isinstance(obj, torch.utils.data.DataLoader):
                result[i] = self.prepare_data_loader(obj, device_placement=placement)
            elif result[i] is obj and isinstance(obj, _scheduler_types()):
                result[i] = self.prepare_scheduler(obj)
        self._resume_if_pending()  # resume=...: restores once everything the checkpoint holds is prepared
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_one(self, obj: Any, device_placement: Optional[bool], evaluation_mode: bool = False) -> Any:
        """A model, dataloader or optimizer prepared by itself (the default of ``Strategy.prepare``); else ``obj``."""
        if isinstance(obj, nn.Module):
            return self.prepare_model(obj, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if isinstance(obj, torch.utils.data.DataLoader):
            return self.prepare_data_loader(obj, device_placement=device_placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=device_placement)
        return obj

    def _already(self, obj: Any) -> Any:
        return self._prepared.get(obj)

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Move ``model`` to the device, add autocast for mixed precision, wrap it for the strategy."""
        done = self._already(model)
        if done is not None:
            return done
        wrapper = foreign_wrapper(model)
        if wrapper is not None:
            raise ValueError(
                f"prepare() got a model already wrapped in {wrapper}; pass the plain nn.Module "
                f"(e.g. model.module) and let hasten wrap it for {self.distributed_type}"
            )
        refuse_offloaded_quantized_model(
            model, lambda: is_bitsandbytes_multi_backend_available() and not is_xpu_available())
        by_user = self.strategy.keeps_user_sharding(model)  # fully_shard / parallelize_module by the user
        if device_placement is None:
            device_placement = self.device_placement
        placed_by_strategy = self.strategy.places_model_itself and not evaluation_mode
        if device_placement and not by_user and not placed_by_strategy and not any(p.is_meta for p in model.parameters()):
            model = model.to(self.device)
        dynamo = self.state.dynamo_plugin
        compiling = dynamo is not None and not dynamo.disable
        if self.fp8 is not None:
            self.strategy.convert_fp8(model, self.fp8)
            self.fp8.speed_up(model, compiled=compiling or unwrap_compiled(model) is not model)
        self.precision.wrap_forward(model)
        # In place, before wrapping (the wrappers' hooks stay on the call path). Without repeated blocks:
        # whole, through the wrapper, as Accelerate (in place, the autocast hooks would be traced).
        regional = compiling and dynamo.use_regional_compilation and has_repeated_blocks(model)
        if regional:
            compile_regions(model, **dynamo.to_compile_kwargs())
        prepared = model if evaluation_mode or by_user else self.strategy.wrap_model(model)
        if compiling and not regional:
            prepared = torch.compile(prepared, **dynamo.to_compile_kwargs())
            self.precision.wrap_compiled(prepared, model)
        return self._prepared.add(model, prepared, "models")

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` so it follows gradient-sync steps and the fp16 scaler."""
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        done = self._already(optimizer)
        if done is not None:
            return done
        if device_placement is None:
            device_placement = self.device_placement
        inner = self.strategy.prepare_optimizer(optimizer)
        prepared = AcceleratedOptimizer(inner, device_placement=device_placement, precision=self.precision)
        return self._prepared.add(optimizer, prepared, "optimizers")

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap an LR scheduler so it steps with its optimizer (see ``hasten.scheduler``)."""
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        done = self._already(scheduler)
        if done is not None:
            return done
        target = getattr(scheduler, "optimizer", None)
        owners = [o for o in self._optimizers if target is o or target is o.optimizer] or self._optimizers
        prepared = AcceleratedScheduler(scheduler, owners, step_with_optimizer=self.step_scheduler_with_optimizer,
                                        split_batches=self.split_batches, stages=self.strategy.mesh.sizes["pp"])
        return self._prepared.add(scheduler, prepared, "schedulers")

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: Optional[bool] = None,
                            slice_fn_for_dispatch: Optional[Callable] = None) -> Any:
        """Shard ``data_loader`` across processes and move its batches to the device."""
        from .data_loader import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader

        if isinstance(data_loader, (DataLoaderShard, DataLoaderDispatcher)):
            return data_loader
        done = self._already(data_loader)
        if done is not None:
            return done
        if device_placement is None:
            device_placement = self.device_placement
        cfg = self.dataloader_config
        # The data-parallel rank and size come from the strategy's mesh: tensor-parallel peers share batches.
        prepared = prepare_data_loader(
            data_loader, self.device, split_batches=cfg.split_batches, put_on_device=device_placement, rng_types=list(self.rng_types),
            dispatch_batches=cfg.dispatch_batches, even_batches=cfg.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=cfg.use_seedable_sampler,
            data_seed=cfg.data_seed, non_blocking=cfg.non_blocking, use_stateful_dataloader=cfg.use_stateful_dataloader,
            data_parallel=self.strategy.mesh.data_parallel(),
        )
        return self._prepared.add(data_loader, prepared, "dataloaders")

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A loader that starts after ``num_batches`` batches of ``dataloader`` (for resuming).

        Scripts written for Accelerate (transformers' ``run_*_no_trainer.py``) resume by hand: after
        ``load_state`` they run the interrupted epoch through ``skip_first_batches(loader, n)`` and
        the next epochs through ``loader``. After ``load_state`` (which left ``loader`` at the start of
        the interrupted epoch, or at its saved batch with ``continue_dataloaders=True``) the returned
        loader plays that epoch from batch ``n``, with its own order, and ``loader`` goes on with the
        next epoch. When ``n`` is where the saved run stood, the returned loader continues exactly as
        that run did (no batch is read twice, no new draw from the restored generators), so the
        resumed run equals the uninterrupted one; Accelerate shuffles that pass anew."""
        from .data.position import STREAM_POSITION_KEYS
        from .data_loader import skip_first_batches

        skipped = skip_first_batches(dataloader, num_batches=num_batches)
        pending = getattr(dataloader, "pending_resume_state", lambda: None)()
        if pending is not None and hasattr(skipped, "load_state_dict"):  # restored by load_state, not iterated since
            dataloader.load_state_dict({"epoch": dataloader.iteration + 1, "batches_yielded": 0})
            if pending["batches_yielded"] != num_batches:  # the epoch's order from another batch
                pending = {k: v for k, v in pending.items() if k not in STREAM_POSITION_KEYS}
                pending["batches_yielded"] = num_batches
            skipped.load_state_dict(pending)  # after the line above: both share the sampler
        return skipped

    # -- the training step ----------------------------------------------------------------------
    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Backward and update with the prepared LOMO optimizers (``hasten.optimizer.lomo_backward``)."""
        lomo_backward(self._optimizers, loss, learning_rate)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` divided by the accumulation steps and scaled for fp16."""
        token = progress.enter(progress.BACKWARD)  # DDP all-reduces the gradients in here
        try:
            self.strategy.backward(loss, self.gradient_accumulation_steps, **kwargs)
        finally:
            progress.leave(token)

    def _do_sync(self) -> None:
        gs = self.gradient_state
        if gs.sync_with_dataloader and gs.end_of_dataloader:
            self.step = 0
            gs._set_sync_gradients(True)
        else:
            self.step += 1
            gs._set_sync_gradients(self.step % gs.num_steps == 0)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Accumulate gradients over micro-steps: no all-reduce until the N-th step (or the last batch)."""
        self._do_sync()
        skip_sync = not self.sync_gradients and not self.gradient_state.sync_each_batch
        with contextlib.ExitStack() as stack:
            if skip_sync:
                for model in models:
                    # The strategy checks the DDP/FSDP module: under torch.compile it sits in the wrapper.
                    stack.enter_context(self.strategy.no_sync(unwrap_compiled(model)))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient synchronisation in backward passes run inside this block."""
        with self.strategy.no_sync(unwrap_compiled(model)):
            yield

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context manager: a backward inside it synchronises gradients across processes, even
        within ``no_sync``/``accumulate`` micro-steps (the flags are restored on exit)."""
        return self.strategy.trigger_sync_in_backward(unwrap_compiled(model))

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Any], even_batches: Optional[bool] = None) -> Iterator[None]:
        """Let DDP models train on ranks that run out of batches at different times.

        ``even_batches`` overrides the Accelerator's value for the prepared map-style dataloaders
        inside the block. Without several processes, or with a strategy other than DDP, nothing
        happens (with a warning for the latter). Dataloaders that shard an iterable dataset on each
        process keep their setting (with a warning).
        """
        if not self.use_distributed:
            yield
            return
        if not self.strategy.supports_join:
            warnings.warn(f"join_uneven_inputs works with DistributedDataParallel only; with {self.distributed_type} "
                          "it has no effect", HastenWarning, stacklevel=3)
            yield
            return
        from torch.distributed.algorithms.join import Join

        changed = []
        if even_batches is not None:
            changed = [dl for dl in self._dataloaders if getattr(dl, "takes_even_batches", False)]
            if len(changed) < len(self._dataloaders):
                warnings.warn(f"join_uneven_inputs(even_batches={even_batches}) cannot change "
                              f"{len(self._dataloaders) - len(changed)} dataloader(s) that shard an iterable dataset "
                              "on each process (dispatch_batches=False); they keep their setting",
                              HastenWarning, stacklevel=3)
            for dl in changed:
                dl.set_even_batches(even_batches)
        else:
            even_batches = self.even_batches
        try:
            with Join([unwrap_compiled(j) for j in joinables], enable=not even_batches, throw_on_early_termination=False):
                yield
        finally:
            for dl in changed:
                dl.set_even_batches(self.even_batches)

    def autocast(self, autocast_handler: Optional[AutocastKwargs] = None) -> contextlib.AbstractContextManager:
        """Run the block under the configured mixed precision (e.g. a loss outside the model)."""
        return self.precision.autocast(autocast_handler)

    def unscale_gradients(self, optimizer: Optional[Union[AcceleratedOptimizer, Sequence[AcceleratedOptimizer]]] = None) -> None:
        """Divide fp16 gradients by the loss scale (at most once per step; no-op otherwise)."""
        if optimizer is None:
            optimizers = self._optimizers
        else:
            optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in optimizers:
            self.precision.unscale_(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def _clip_allowed(self, what: str) -> bool:
        if self.sync_gradients:
            return True
        # Clipping a partial accumulation would change the result (and unscaling it would break
        # fp16); Accelerate does both. We wait for the sync step.
        warn_once(f"{what} called on a gradient-accumulation micro-step: gradients are not clipped until the "
                  "sync step (guard it with `if accelerator.sync_gradients:`)")
        return False

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Optional[torch.Tensor]:
        """Unscale (once) and clip gradients; returns the total norm before clipping.

        On accumulation micro-steps nothing is clipped or unscaled: the result is the norm of the
        gradients this process accumulated so far, not yet reduced across processes (divided by the
        fp16 loss scale; the same under DDP and FSDP2), so ``norm.item()`` can be logged on every step.
        """
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not self._clip_allowed("clip_grad_norm_"):
            norm = self.strategy.grad_norm(parameters, norm_type=norm_type)
            scale = self.precision.gradient_scale()
            return norm / scale if scale != 1.0 else norm
        self.unscale_gradients(optimizers_owning(self._optimizers, parameters))
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale (once) and clamp every gradient to ``[-clip_value, clip_value]``."""
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if self._clip_allowed("clip_grad_value_"):
            self.unscale_gradients(optimizers_owning(self._optimizers, parameters))
            self.strategy.clip_grad_value_(parameters, clip_value)

    # -- collectives ----------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Concatenate (nested) tensors from all processes along the first dimension."""
        from .utils.operations import gather

        return gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation: exactly the dataset's samples, without the padding duplicates."""
        from .data_loader import gather_for_metrics

        return gather_for_metrics(input_data, use_gather_object=use_gather_object,
                                  data_parallel=self.strategy.mesh.data_parallel())

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce (nested) tensors over processes: "sum", "mean", "max" or "min"."""
        from .utils.operations import reduce

        return reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad (nested) tensors to the largest size over processes along ``dim``."""
        from .utils.operations import pad_across_processes

        return pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def set_trigger(self) -> None:
        """Raise a flag on this process that ``check_trigger`` sees on every process."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process if any process called ``set_trigger`` (then the flag is reset)."""
        from .utils.operations import reduce

        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        fired = reduce(self.flag_tensor, reduction="sum")
        if int(fired.item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    # -- models and weights ---------------------------------------------------------------------
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> nn.Module:
        """The user's module inside the wrappers that ``prepare`` added."""
        inner = unwrap_compiled(model)
        compiled = model if inner is not model else None
        inner = self.strategy.unwrap_model(inner)
        while foreign_wrapper(inner) in ("DistributedDataParallel", "DataParallel"):
            inner = inner.module
        if not keep_fp32_wrapper:  # as Accelerate: the prepared model (and its compiled form) stops autocasting too
            for wrapped in (inner, compiled) if compiled is not None else (inner,):
                Precision.unwrap_forward(wrapped)
        if compiled is not None and keep_torch_compile:
            compiled._orig_mod = inner
            return compiled
        return inner

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict, as the strategy reassembles it."""
        if unwrap:
            return self.strategy.model_state_dict(self.unwrap_model(model, keep_torch_compile=False))
        return model.state_dict()

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Write ``obj`` once (main process, or once per node with ``save_on_each_node``), atomically."""
        from .saving import save

        save(obj, f, save_on_each_node=self.project_configuration.save_on_each_node, safe_serialization=safe_serialization)

    def save_model(self, model: nn.Module, save_directory: str, max_shard_size: Union[int, str] = "10GB",
                   safe_serialization: bool = True) -> None:
        """Write the model's weights (safetensors by default, sharded with an index when large)."""
        from .saving import save_model

        main = self.is_local_main_process if self.project_configuration.save_on_each_node else self.is_main_process
        inner = self.unwrap_model(model, keep_torch_compile=False)
        if safe_serialization and self.strategy.write_full_weights(inner, save_directory, max_shard_size, main):
            return
        if any(p.device.type == "meta" for p in inner.parameters()):  # offloaded (big-model hooks): read them back
            from .utils.offload_state import get_state_dict_offloaded_model

            state_dict = get_state_dict_offloaded_model(inner)
            missing = [k for k in inner.state_dict() if k not in state_dict]
            if missing:
                raise ValueError(f"save_model: {missing} are on the meta device with no offloaded copy; load "
                                 "them (load_checkpoint_in_model) before saving")
        else:
            state_dict = self.get_state_dict(model)
        save_model(state_dict, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization,
                   is_main_process=self.is_local_main_process if self.project_configuration.save_on_each_node
                   else self.is_main_process)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Add objects (with ``state_dict``/``load_state_dict``) to what ``save_state`` will store."""
        bad = [f"Item at index {i} ({type(obj).__name__})" for i, obj in enumerate(objects)
               if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))]
        if bad:  # ValueError, and every bad item named, as Accelerate
            raise ValueError(f"register_for_checkpointing: {'; '.join(bad)} has no state_dict()/load_state_dict(); "
                             "wrap each in a class that provides both")
        first = len(self._custom_objects)
        self._prepared.custom_objects.extend(objects)
        self._restore_registered_since(first)  # resume=...: state saved for objects registered after the resume

    # -- profiling ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def profile(self, profile_handler: Optional[ProfileKwargs] = None) -> Iterator[Any]:
        """Profile the block with ``torch.profiler``; yields the profiler.

        Settings come from ``profile_handler``, else the ``ProfileKwargs`` given in
        ``kwargs_handlers``, else the defaults. With ``output_trace_dir`` set, each process writes
        ``profile_<rank>.json`` there (Chrome trace format; open it in Perfetto).
        """
        from .profiling import profile

        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with profile(handler, self.process_index, self.wait_for_everyone) as profiler:
            yield profiler

    # -- ending ---------------------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[None]:
        """Drop every reference this Accelerator holds (and to ``objects``) and empty device caches."""
        from .utils.memory import release_memory

        self.wait_for_checkpoint()
        self._finish_trackers()
        self._checkpoints.release()  # the background saver's staging buffers
        self._prepared.clear()  # what prepare() handed out (registered objects stay)
        self.strategy.release()  # e.g. DeepSpeed engines
        self.step = 0
        return release_memory(*objects)

    clear = free_memory

    def end_training(self) -> None:
        """Wait for a background save, finish trackers, wait for every process, tear the process group down."""
        self.wait_for_checkpoint()
        self._finish_trackers()
        if (self.use_distributed or getattr(self.state, "owns_group", False)) and torch.distributed.is_initialized():
            self.wait_for_everyone()
            quiesce_gloo_workers()  # no gloo thread may still be letting go of a tensor when the script ends
            self.state.destroy_process_group()

    def __repr__(self) -> str:
        return f"Accelerator({self.distributed_type}, processes={self.num_processes}, device={self.device}, " \
               f"mixed_precision={self.mixed_precision!r})"


def _recorded_cuda_event() -> torch.cuda.Event:
    """A timing event recorded now on the current CUDA stream (for ``progress.DeviceWorkTimer``)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _scheduler_types() -> tuple[type, ...]:
    kinds: list[type] = [torch.optim.lr_scheduler.LRScheduler]
    plateau = getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", None)
    if plateau is not None and plateau not in kinds:
        kinds.append(plateau)
    return tuple(kinds)
