"""DeepSpeed ZeRO (stages 0-3) behind the strategy interface.

``prepare`` hands the model and its optimizer to ``deepspeed.initialize`` together (one engine per
trained model); DeepSpeed then owns gradient reduction, partitioning, precision (its bf16/fp16
sections, not autocast) and clipping (its ``gradient_clipping``). The loop stays unchanged:
``accelerator.backward`` runs ``engine.backward``; on a sync step ``engine.step`` (which clips,
steps and zeroes) is held until the first of ``clip_grad_norm_`` (which sets the engine's clipping
for that step, as torch's call would clip), the prepared optimizer's ``step``, a prepared
scheduler's ``step`` (the schedule advances after the update, as in torch), or, for loops that
leave the stepping to ``backward`` as Accelerate allows, the engine's next training forward or
``backward``, a checkpoint or a state dict (see ``DeepSpeedStrategy.settle``). On CPU, hasten keeps DeepSpeed from compiling ops: its shared-memory
collectives are marked unavailable and an ``optimizer`` section of the config becomes the equivalent torch optimizer.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from .. import progress
from ..optimizer import AcceleratedOptimizer
from ..precision import Precision
from ..prepared import Built, PrepareCall
from ..utils.dataclasses import DistributedType
from ..utils.deepspeed import DummyOptim, DummyScheduler
from ..utils.deepspeed_plugin import AUTO, DeepSpeedPlugin
from .base import Params, Strategy


def _engine_class() -> type:
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def import_deepspeed(device_type: str) -> Any:
    """``deepspeed``, with the CPU path kept free of op compilation."""
    try:
        import deepspeed
    except ImportError:
        raise ImportError("deepspeed_plugin needs DeepSpeed: pip install 'hasten[deepspeed]' (on CPU with "
                          "DS_BUILD_OPS=0)") from None
    if device_type == "cpu":
        # Its first CPU start would otherwise build the shared-memory collectives (~80 s); gloo does the job.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


class DeepSpeedOptimizer(AcceleratedOptimizer):
    """The prepared optimizer of a DeepSpeed engine: ``step`` runs the engine's pending step (which
    also zeroes), unless ``clip_grad_norm_`` ran it."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Any, strategy: "DeepSpeedStrategy") -> None:
        super().__init__(optimizer, device_placement=False, precision=None)
        self.engine = engine
        self.strategy = strategy

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # engine.step() zeroed them

    def step(self, closure: Any = None) -> None:
        # The engine's step of this sync step, unless clip_grad_norm_ already ran it.
        self.strategy.finish_step(by=OPTIMIZER_STEP)
        if self.gradient_state.sync_gradients:
            progress.stepped()

    def before_schedule(self) -> None:
        """A prepared scheduler is about to advance: this backward's held step runs first, so the
        update uses the learning rate of its own iteration (torch: ``optimizer.step()`` before
        ``scheduler.step()``), also in loops that never call ``optimizer.step()``."""
        self.strategy.settle(SCHEDULER_STEP)

    @property
    def step_was_skipped(self) -> bool:
        """Whether DeepSpeed's fp16 loss scaler dropped the last step (gradients overflowed)."""
        inner = self.engine.optimizer
        return bool(getattr(inner, "overflow", False)) and self.gradient_state.sync_gradients

    @property
    def skip_flag(self) -> bool:
        return self.step_was_skipped

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()


# The calls that run a held step. The first two are the loop's own step calls; the others run it
# for loops that leave the stepping to ``backward`` (Accelerate's DeepSpeed contract).
OPTIMIZER_STEP, CLIP = "optimizer.step()", "accelerator.clip_grad_norm_"
BACKWARD, FORWARD, SCHEDULER_STEP = "accelerator.backward", "a forward with gradients enabled", "scheduler.step()"
SAVE, LOAD, STATE_DICT, EVAL_FORWARD = "save_state", "load_state", "get_state_dict", "a forward under torch.no_grad()"
# Reads that a loop stepping by itself makes before its step (a metric, a state dict): they see the
# parameters before the step, as torch's would, unless the loop is known to leave the step to backward.
_READS = (STATE_DICT, EVAL_FORWARD)


class DeepSpeedSchedulerWrapper:
    """The engine's scheduler (from the config's ``scheduler`` section): DeepSpeed steps it."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


class DeepSpeedStrategy(Strategy):
    """ZeRO data parallelism over every process. Reads ``plan.deepspeed_plugin``."""

    distributed_type = DistributedType.DEEPSPEED
    checkpoint_format = "deepspeed"

    def __init__(self, plan: Any) -> None:
        plugin = plan.deepspeed_plugin
        self._first_plugin = plugin if isinstance(plugin, DeepSpeedPlugin) else DeepSpeedPlugin()
        self.mode = plan.mixed_precision
        self.engines: list[Any] = []  # engines of trained models (the first one takes accelerator.backward)
        self.inference_engines: list[Any] = []  # ZeRO-3 engines of models prepared without an optimizer
        self.config: Optional[dict] = None
        # The sync step's engine.step() waits for clip_grad_norm_, optimizer.step() or the next forward/backward.
        self.step_pending = False
        # What the loop showed: True once it called optimizer.step()/clip_grad_norm_, False when a held
        # step had to be run by the next backward, training forward or scheduler.step() (no
        # optimizer.step() in the loop: Accelerate's "backward steps"), None before either.
        self.loop_steps: Optional[bool] = None
        self.ran_by: Optional[str] = None  # the call other than clip/step that ran this backward's step
        self.stale_read: Optional[str] = None  # a read that saw this backward's parameters before the step
        self.hooks: list[Any] = []  # handles of the engines' forward pre-hooks that run a pending step
        self.configured_clipping = 0.0  # the config's gradient_clipping (0: clip_grad_norm_ sets it per step)
        self.clipping_from_auto = False  # True: filled from "auto", which a clip_grad_norm_ call overrides
        super().__init__(plan)
        self.zero3_init_config = self._zero3_init()

    @property
    def plugin(self) -> DeepSpeedPlugin:
        """The active plugin (``deepspeed_plugins`` + ``state.select_deepspeed_plugin``): what the next
        engine is built with."""
        active = getattr(self.state, "deepspeed_plugin", None)
        return active if isinstance(active, DeepSpeedPlugin) else self._first_plugin

    def _zero3_init(self) -> Any:
        """With ``zero3_init_flag`` at stage 3, let transformers build models already partitioned."""
        if not (self.plugin.zero3_init_flag and self.plugin.zero_stage_value == 3):
            return None
        try:
            from transformers.integrations import HfDeepSpeedConfig
        except ImportError:
            return None
        deepspeed = import_deepspeed(self.state.device.type)
        _init_comm(deepspeed, self.state)
        # transformers holds only a weak reference: the strategy keeps it alive for the run.
        return HfDeepSpeedConfig(_without_autos(self.plugin.deepspeed_config, self.mode))

    def build_precision(self, mode: str, scaler_kwargs: Any, autocast_kwargs: Any) -> Precision:
        return Precision("no", self.state.device)  # the engine's bf16/fp16 sections do it

    def describe(self) -> dict[str, Any]:
        return dict(super().describe(), zero_stage=self._first_plugin.zero_stage_value)

    def release(self) -> None:
        self.finish_step(by="release")
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        self.engines.clear()
        self.inference_engines.clear()

    def checkpoint_backend(self) -> Any:
        """Engine checkpoints (``engine.save_checkpoint``) of the trained models inside hasten's commit,
        bound to these engines; models without an optimizer are stored as their full weights."""
        from ..checkpointing.deepspeed_state import DeepSpeedCheckpoint

        # save_state and load_state settle a held step through it (``settle``), after their own checks.
        return DeepSpeedCheckpoint(self.state, self.load_model_state_dict, engine_of=self.trained_engine_of,
                                   zero_stage=self._first_plugin.zero_stage_value, weights_of=self.model_state_dict,
                                   settle=self.settle)

    # -- joint preparation ----------------------------------------------------------------------
    def check_prepare_arguments(self, objects: tuple) -> None:
        """``DummyOptim``/``DummyScheduler`` are welcome: the engine builds them from the config."""

    def prepare(self, call: PrepareCall) -> dict[int, Any]:
        """One engine for the trained model of a ``prepare`` call, built with its optimizer (and
        the config's scheduler); models without an optimizer are prepared for evaluation. A torch
        scheduler is left to the Accelerator, which prepares it once the engine's optimizer is recorded.
        Dataloaders come first: their batch size fills the engine's config."""
        out: dict[int, Any] = {i: call.one_by_one(o, placement) for i, o, placement in call.items
                               if isinstance(o, torch.utils.data.DataLoader)}
        models = [(i, o) for i, o, _ in call.items if isinstance(o, nn.Module)]
        optims = [(i, o) for i, o, _ in call.items if isinstance(o, (torch.optim.Optimizer, DummyOptim))]
        scheds = [(i, o) for i, o, _ in call.items if isinstance(o, DummyScheduler) or hasattr(o, "get_last_lr")]
        if len(optims) > 1 or (optims and len(self.engines) + 1 > 1):
            raise ValueError(f"DeepSpeed trains one model per Accelerator; prepare() got {len(optims)} optimizer(s)"
                             f" with {len(self.engines)} engine(s) already built. Train the other models in a "
                             "separate run, or combine them in one nn.Module with one optimizer")
        trained = None
        if optims:
            pos, opt = optims[0]
            owner = _owner_of(opt, [m for _, m in models])
            if owner is None:
                raise ValueError(f"prepare(): the optimizer (argument {pos}) updates no model of this prepare() call; "
                                 "DeepSpeed builds model and optimizer together: accelerator.prepare(model, optimizer, "
                                 "...)")
            trained = owner
        for i, model in models:
            if model is trained:
                continue
            if self.plugin.zero_stage_value == 3:  # partitioned for inference, as Accelerate does
                out[i] = Built(model, self._initialize_inference(call, model), "models")
            else:  # evaluation-only models: plain modules on the device
                out[i] = call.one_by_one(model, None, evaluation_mode=True)
        if trained is None:
            for i, sched in scheds:
                raise ValueError(f"prepare(): the scheduler (argument {i}) needs its model and optimizer in the same "
                                 "prepare() call under DeepSpeed")
            return out
        m_pos = next(i for i, m in models if m is trained)
        o_pos, opt = optims[0]
        s_pos, sched = scheds[0] if scheds else (None, None)
        engine, optimizer, ds_sched = self._initialize(call, trained, opt, sched)
        out[m_pos] = Built(trained, engine, "models")
        out[o_pos] = Built(opt, optimizer, "optimizers")
        if s_pos is not None and ds_sched is not None:  # the engine steps it: handed back, not recorded
            out[s_pos] = Built(sched, DeepSpeedSchedulerWrapper(ds_sched), None)
        return out

    def _initialize(self, call: PrepareCall, model: nn.Module, opt: Any, sched: Any) -> tuple[Any, Any, Any]:
        from .deepspeed_config import resolve_config
        from .deepspeed_ulysses import no_sequence_parallel, sequence_parallel_engine

        deepspeed = import_deepspeed(self.state.device.type)
        _check_fp16_support(self.mode, self.state.device)
        sp = getattr(self.parallelism_config, "sp_size", 1) or 1
        config, torch_opt, build_sched = resolve_config(self.plugin, self.state, call, model, opt, sched,
                                                        data_parallel=self.state.num_processes // sp)
        self.config = config
        _init_comm(deepspeed, self.state)
        model = model.to(self.state.device)
        extra = sequence_parallel_engine(model, sp, self.mesh) if sp > 1 else no_sequence_parallel()  # mpu or none
        if self.plugin.leaf_modules():
            from deepspeed.utils import set_z3_leaf_modules

            classes = {type(m) for m in model.modules() if type(m).__name__ in self.plugin.leaf_modules()}
            set_z3_leaf_modules(model, list(classes))
        engine, _, _, ds_sched = deepspeed.initialize(model=model, optimizer=torch_opt, config=config,
                                                      lr_scheduler=build_sched, dist_init_required=False, **extra)
        _share_fp32_master(engine.optimizer)
        self.engines.append(engine)
        # A loop without optimizer.step(): the sync step's engine.step() runs before the next forward.
        self.hooks.append(engine.register_forward_pre_hook(
            lambda module, args: self.settle(FORWARD if torch.is_grad_enabled() else EVAL_FORWARD)))
        self.configured_clipping = float(engine.gradient_clipping() or 0.0)
        # Filled from "auto" (Accelerate's rule: 1.0): a clip_grad_norm_ call of the step sets its own max_norm.
        self.clipping_from_auto = _clipping_from_auto(self.plugin)
        engine_sched = ds_sched if isinstance(sched, DummyScheduler) else None
        return engine, DeepSpeedOptimizer(torch_opt, engine, self), engine_sched

    def _initialize_inference(self, call: PrepareCall, model: nn.Module) -> Any:
        """A ZeRO-3 engine without optimizer for a model prepared alone (a frozen teacher or reference):
        its parameters are partitioned over the processes and gathered layer by layer in forward."""
        from .deepspeed_config import resolve_config

        deepspeed = import_deepspeed(self.state.device.type)
        _check_fp16_support(self.mode, self.state.device)
        config, _, _ = resolve_config(self.plugin, self.state, call, model, None, None)
        _init_comm(deepspeed, self.state)
        training = model.training
        engine, _, _, _ = deepspeed.initialize(model=model.to(self.state.device), config=config,
                                               dist_init_required=False)
        engine.train(training)  # the engine keeps the mode the user gave the model (eval for a reference)
        self.inference_engines.append(engine)
        return engine

    # -- the model ------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        raise ValueError("under DeepSpeed, pass the model to prepare() together with its optimizer "
                         "(accelerator.prepare(model, optimizer, ...)); a model alone is prepared for evaluation")

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, _engine_class()) else model

    def engine_of(self, model: nn.Module) -> Optional[Any]:
        """The engine (trained or inference) of a prepared model, or None."""
        return _engine_among(self.engines + self.inference_engines, model)

    def trained_engine_of(self, model: nn.Module) -> Optional[Any]:
        """The engine of a model prepared with its optimizer, or None."""
        return _engine_among(self.engines, model)

    # -- a training step ------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, accumulation_steps: int = 1, **kwargs: Any) -> None:
        """``engine.backward`` (which divides by the accumulation steps itself); on a sync step the
        ``engine.step`` is left pending for ``clip_grad_norm_``/``optimizer.step()`` (see ``finish_step``)."""
        if not self.engines:
            raise RuntimeError("accelerator.backward under DeepSpeed needs a model prepared with its optimizer")
        from ..state import GradientState

        self.settle(BACKWARD)  # a loop without optimizer.step(): the last sync step's engine.step, in order
        self.ran_by = None
        sync = GradientState().sync_gradients
        engine = self.engines[0]
        engine.set_gradient_accumulation_boundary(is_boundary=sync)
        engine.backward(loss, **kwargs)
        self.step_pending = sync

    def settle(self, by: str) -> None:
        """``by`` (one of the names above) is about to run while this backward's step may be held.

        A loop's own step calls run it (``finish_step``). A read (a forward under ``no_grad``,
        ``get_state_dict``) leaves it held, seeing the parameters before the step as torch does,
        unless the loop has shown that it leaves the stepping to ``backward``. ``save_state`` in a
        loop that calls ``optimizer.step()`` is refused (a checkpoint cannot hold the gradients the
        step waits on); otherwise save, load, the next training forward or backward and
        ``scheduler.step()`` run it, and a ``clip_grad_norm_`` of that same step is then an error.
        """
        if not self.step_pending:
            return
        if by in _READS and self.loop_steps is not False:
            self.stale_read = self.stale_read or by
            return
        if by == SAVE and self.loop_steps:
            raise ValueError(
                "save_state between accelerator.backward and optimizer.step(): DeepSpeed's step of that backward has "
                "not run yet, and a checkpoint cannot hold the gradients it waits on; call save_state after "
                "optimizer.step() (and clip_grad_norm_)")
        self.finish_step(by=by)

    def finish_step(self, max_norm: Optional[float] = None, by: str = OPTIMIZER_STEP) -> None:
        """Run the pending ``engine.step()``, clipping at ``max_norm`` (a ``clip_grad_norm_`` call of
        this step) or else at the config's ``gradient_clipping`` (0: none, as torch without the call)."""
        if by in (OPTIMIZER_STEP, CLIP):
            self.loop_steps = True
        if not self.step_pending:
            return
        if by in (BACKWARD, FORWARD, SCHEDULER_STEP):
            if self.stale_read is not None and self.loop_steps is None:
                from ..state import warn_once

                warn_once(f"{self.stale_read} between accelerator.backward and the DeepSpeed step of that backward saw "
                          "the parameters before the step: this loop calls no optimizer.step(), which hasten learnt "
                          f"only when {by} ran the step. From now on such calls run the held step first; call "
                          "optimizer.step() after accelerator.backward to make the order explicit")
            self.loop_steps = False
        if by not in (OPTIMIZER_STEP, CLIP):
            self.ran_by = by
        self.step_pending = False
        self.stale_read = None
        engine = self.engines[0]
        _set_clipping(engine, self.configured_clipping if max_norm is None else float(max_norm))
        engine.step()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the engine reduces only at the accumulation boundary

    def clip_grad_norm_(self, parameters: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Run this sync step's ``engine.step()`` clipping at ``max_norm`` (the engine clips the global
        L2 norm inside its step); returns the norm before clipping, which the engine computed."""
        engine = self.engines[0]
        configured = self.configured_clipping
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}) under DeepSpeed: its engine clips the L2 norm "
                             "only; use norm_type=2")
        if self.ran_by is not None and not self.step_pending:
            # The step of this backward already ran, unclipped: clipping now would do nothing.
            raise ValueError(
                f"clip_grad_norm_ after {self.ran_by} ran the DeepSpeed step of this backward without clipping "
                f"(DeepSpeed clips inside its step): call clip_grad_norm_ right after accelerator.backward, before "
                f"{self.ran_by}")
        if configured and not self.clipping_from_auto and abs(configured - float(max_norm)) > 1e-12:
            # Checked before the engine steps; the config is the same on every rank, so every rank
            # raises this same error at the first call.
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}) but the DeepSpeed config sets gradient_clipping={configured}: "
                f"call clip_grad_norm_ with max_norm={configured}, or remove gradient_clipping from the config "
                "(and `hasten launch --gradient_clipping`) to let clip_grad_norm_ set it"
            )
        self.finish_step(max_norm, by=CLIP)
        norm = engine.get_global_grad_norm()
        return norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm or 0.0))

    def grad_norm(self, parameters: Params, norm_type: float = 2.0) -> torch.Tensor:
        """On an accumulation micro-step: the norm of the ``.grad`` the parameters hold. ZeRO-2/3
        reduce and partition each micro-step's gradients in backward (no ``.grad`` is left), so
        there it is 0.0 and a warning says so once."""
        stage = _stage(self.engines[0]) if self.engines else self.plugin.zero_stage_value
        if stage is not None and stage >= 2:
            from ..state import warn_once

            warn_once(f"clip_grad_norm_ on an accumulation micro-step under DeepSpeed ZeRO-{stage} returns 0.0: ZeRO-2/3 "
                      "reduce and partition the gradients in backward, so this process's accumulated gradients are not "
                      "held anywhere; the norm is known at the sync step (guard the call with "
                      "`if accelerator.sync_gradients:`)")
        return super().grad_norm(parameters, norm_type)

    def clip_grad_value_(self, parameters: Params, clip_value: float) -> None:
        raise ValueError("clip_grad_value_ is not available under DeepSpeed (it clips by norm inside its step); use "
                         "clip_grad_norm_ with gradient_clipping set in the DeepSpeed config")

    # -- state dict I/O -------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module, everyone: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on CPU; ZeRO-3 parameters are gathered one at a time (every process must call)."""
        self.settle(STATE_DICT)
        module = self.unwrap_model(model)
        if not _partitioned(module):
            return {k: v.detach().cpu() for k, v in module.state_dict().items()}
        import deepspeed

        out: dict[str, torch.Tensor] = {}
        params = dict(module.named_parameters())
        for name, tensor in module.state_dict(keep_vars=True).items():
            if name in params and hasattr(tensor, "ds_id"):
                with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                    out[name] = tensor.detach().cpu().clone()
            else:
                out[name] = tensor.detach().cpu().clone()
        return out

    def load_model_state_dict(self, model: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load a full state dict (every process holds it); the engine's fp32 master copies follow."""
        module = self.unwrap_model(model)
        if not _partitioned(module):
            result = module.load_state_dict(state_dict, strict=strict)
        else:
            import deepspeed

            own = {n for n, _ in module.named_parameters()}
            missing = sorted(own - set(state_dict))
            if strict and missing:
                raise ValueError(f"load_state_dict: missing keys {missing[:8]}")
            for name, param in module.named_parameters():
                if name in state_dict:
                    # modifier_rank: without it DeepSpeed re-partitions the old values and drops the copy.
                    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                        with torch.no_grad():
                            param.copy_(state_dict[name])
            with torch.no_grad():
                for name, buf in module.named_buffers():
                    if name in state_dict:
                        buf.copy_(state_dict[name])
            result = None
        engine = self.engine_of(module)
        refresh = getattr(getattr(engine, "optimizer", None), "refresh_fp32_params", None)
        if refresh is not None:  # ZeRO keeps fp32 masters apart from the module's parameters
            refresh()
        return result


def _set_clipping(engine: Any, max_norm: float) -> None:
    """Make the engine's next step clip at ``max_norm`` (0: off). The engine reads its config's
    value (stage 0, fp32) and each DeepSpeed optimizer (ZeRO 1-3, fp16, bf16) its ``clip_grad``,
    both taken from the config when the engine was built."""
    from ..checkpointing.deepspeed_api import version_error

    config = getattr(engine, "_config", None)
    if not callable(getattr(engine, "gradient_clipping", None)) or not hasattr(config, "gradient_clipping"):
        raise version_error("DeepSpeedEngine.gradient_clipping() and its _config.gradient_clipping (set to clip at "
                            "clip_grad_norm_'s max_norm)", "engines without them")
    if float(engine.gradient_clipping() or 0.0) == max_norm:
        return
    zero_config = getattr(engine._config, "zero_config", None)
    if max_norm > 0 and zero_config is not None and not getattr(zero_config, "compute_grad_norm", True):
        raise ValueError(f"clip_grad_norm_(max_norm={max_norm}) under DeepSpeed needs the gradient norm, but the "
                         "config sets zero_optimization.compute_grad_norm=false: remove that setting, or the "
                         "clip_grad_norm_ call")
    previous = config.gradient_clipping
    engine._config.gradient_clipping = max_norm
    if float(engine.gradient_clipping() or 0.0) != max_norm:  # the engine no longer reads the field we set
        engine._config.gradient_clipping = previous
        raise version_error("DeepSpeedEngine.gradient_clipping() to return its _config.gradient_clipping",
                            f"an engine whose gradient_clipping() stayed {engine.gradient_clipping()} after setting "
                            f"it to {max_norm} (clipping would silently not happen)")
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = max_norm


def _clipping_from_auto(plugin: DeepSpeedPlugin) -> bool:
    """Whether the config left ``gradient_clipping`` to the integration ("auto" or unset in the plugin)."""
    from ..utils.deepspeed_plugin import get_path

    return get_path(plugin.deepspeed_config, "gradient_clipping") == AUTO


def _without_autos(config: dict, mode: str) -> dict:
    """The config as ``deepspeed.zero.Init`` reads it before the script's values are known."""
    def strip(node: Any) -> Any:
        return {k: strip(v) for k, v in node.items() if v != AUTO} if isinstance(node, dict) else node

    out = strip(config)
    for name in ("bf16", "fp16"):  # parameters are created in the run's precision
        out.setdefault(name, {})["enabled"] = mode == name
    out.setdefault("train_micro_batch_size_per_gpu", 1)
    return out


def _check_fp16_support(mode: str, device: torch.device) -> None:
    """DeepSpeed refuses fp16 on processors without oneDNN fp16 from deep inside its engine; say so up front."""
    if mode != "fp16" or device.type != "cpu":
        return
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        raise ValueError("mixed_precision='fp16' with DeepSpeed on CPU: DeepSpeed refuses fp16 on this processor "
                         "(it needs oneDNN fp16 support, AVX512-FP16 or AMX-FP16); use mixed_precision='bf16' "
                         "(--mixed_precision bf16), or 'no'")


def _share_fp32_master(optimizer: Any) -> None:
    """Drop ZeRO-3's second fp32 copy of its partitions when the model already trains in fp32.

    DeepSpeed's stage 3 means to let the fp32 master partitions be the parameter partitions
    themselves when dtype and device agree (``_create_fp32_partitions``), but it compares a
    ``torch.device`` with a device name string, which is never equal, so it always clones: one more
    full partition per process (a quarter of ZeRO-3's parameter + gradient + Adam bytes). Pointing
    the master tensors at the parameter partitions gives the sharing it intended; the step's copy of
    master into parameters becomes a copy onto itself.
    """
    lows = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if not lows or not masters or len(lows) != len(masters):
        return
    if getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "offload_param", False) \
            or getattr(optimizer, "optimizer_swapper", None) is not None:
        return  # the master copy lives elsewhere (CPU / NVMe)
    for low, master in zip(lows, masters):
        if (low is None or master is low or low.dtype != master.dtype or low.device != master.device
                or low.shape != master.shape):
            continue
        master.data = low.data


def _stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


def _engine_among(engines: list[Any], model: nn.Module) -> Optional[Any]:
    for engine in engines:
        if model is engine or model is engine.module:
            return engine
    return None


def _partitioned(module: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _owner_of(opt: Any, models: list[nn.Module]) -> Optional[nn.Module]:
    if isinstance(opt, DummyOptim):
        opt.params = list(opt.params)  # often a generator: read it once, keep it for the real optimizer
    params = opt.params if isinstance(opt, DummyOptim) else [p for g in opt.param_groups for p in g["params"]]
    ids = set()
    for p in params:
        if isinstance(p, dict):
            ids.update(id(q) for q in p["params"])
        else:
            ids.add(id(p))
    for model in models:
        if any(id(p) in ids for p in model.parameters()):
            return model
    return None


def _init_comm(deepspeed: Any, state: Any) -> None:
    """Make DeepSpeed's communication layer use hasten's process group."""
    import torch.distributed as dist

    from deepspeed import comm

    import os

    # DeepSpeed reads the launcher's variables; a plain `python train.py` has none. LOCAL_SIZE is what
    # the deepspeed launcher sets: without it, its CPU accelerator runs `numactl --hardware` in a
    # subprocess each time it counts devices, which is on every training step.
    values = [("LOCAL_RANK", state.local_process_index), ("RANK", state.process_index),
              ("WORLD_SIZE", state.num_processes)]
    if state.device.type == "cpu":
        values.append(("LOCAL_SIZE", state.topology.local_world_size))
    for name, value in values:
        os.environ.setdefault(name, str(value))
    if not dist.is_initialized():  # one process: DeepSpeed still talks through a (1-process) group
        backend = "gloo" if state.device.type == "cpu" else "nccl"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not comm.is_initialized():
        backend = dist.get_backend() if dist.is_initialized() else ("gloo" if state.device.type == "cpu" else "nccl")
        deepspeed.init_distributed(dist_backend=backend, dist_init_required=False, verbose=False)
