"""Configuration objects of the public API (same names and fields as Accelerate's).

Torch is imported lazily here so that the CLI can use the enums without paying for it.
"""

from __future__ import annotations

import enum
import os
from dataclasses import KW_ONLY, dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Union

from .kwargs_handler import KwargsHandler


class DistributedType(str, enum.Enum):
    """How the processes of a job cooperate."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_XPU = "MULTI_XPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"

    def __str__(self) -> str:  # prints as "MULTI_CPU", not "DistributedType.MULTI_CPU"
        return self.value


class PrecisionType(str, enum.Enum):
    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


class RNGType(str, enum.Enum):
    """A random number generator that ``synchronize_rng_state`` can copy from process 0."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class DynamoBackend(str, enum.Enum):
    """Names of ``torch.compile`` backends (any backend registered with torch is accepted too)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    IPEX = "IPEX"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class DDPCommunicationHookType(str, enum.Enum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for ``torch.nn.parallel.DistributedDataParallel``."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def to_dict(self, ignore_keys=("comm_hook", "comm_wrapper", "comm_state_option")) -> dict[str, Any]:
        return {k: v for k, v in super().to_dict().items() if k not in ignore_keys}

    def to_kwargs_for_ddp(self) -> dict[str, Any]:
        """The changed fields that ``DistributedDataParallel`` itself takes."""
        return {k: v for k, v in self.to_kwargs().items() if k not in ("comm_hook", "comm_wrapper", "comm_state_option")}

    def register_comm_hook(self, model) -> None:
        """Install the chosen gradient-communication hook on a DDP model."""
        hook = DDPCommunicationHookType(self.comm_hook)
        if hook == DDPCommunicationHookType.NO:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
            DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
            DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
        }
        wrappers = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
        }
        fn = hooks[hook]
        state = None
        if hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD):
            state = powerSGD_hook.PowerSGDState(process_group=None, **self.comm_state_option)
        wrapper = DDPCommunicationHookType(self.comm_wrapper)
        if wrapper != DDPCommunicationHookType.NO:
            fn = wrappers[wrapper](fn)
        model.register_comm_hook(state, fn)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for ``torch.amp.GradScaler`` (used with fp16)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for ``torch.distributed.init_process_group``.

    ``hang_timeout`` (hasten only, not passed to torch): seconds without progress after which
    ``hasten launch`` reports a hang and stops the job (a number or a ``timedelta``; 0 turns the
    check off); overrides ``--hang_timeout`` for this job. ``None`` keeps the launcher's value.
    """

    backend: Optional[str] = None
    init_method: Optional[str] = None
    timeout: Optional[timedelta] = None
    _: KW_ONLY  # hasten's own settings follow, so Accelerate's positional calls keep their meaning
    hang_timeout: Optional[Union[float, timedelta]] = None

    def to_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.to_dict().items() if v is not None and k != "hang_timeout"}


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for ``torch.autocast``."""

    enabled: bool = True
    cache_enabled: Optional[bool] = None


_CHECKPOINT_MODES = ("full", "selective", "every_k")


@dataclass
class ActivationCheckpointingKwargs(KwargsHandler):
    """Activation checkpointing of the model's repeated blocks, applied at ``prepare`` (hasten only).

    Works with one process, DDP, FSDP2 and tensor parallelism (DeepSpeed has its own settings).
    The blocks are the modules of ``block_classes``, else transformers' ``_no_split_modules``, else
    the items of a ``ModuleList`` of one class; a model without any is an error.

    mode: "full" recomputes every block in backward (keeps only its input); "every_k" does so for
        blocks 0, every, 2*every, ...; "selective" keeps each block's matrix-product and attention
        outputs and recomputes the cheap ops between them.
    every: with mode="every_k", the spacing of checkpointed blocks (a whole number >= 2).
    offload: keep what the checkpointed blocks save for backward (their inputs) in host memory.
    block_classes: class names of the blocks, e.g. ["LlamaDecoderLayer"].
    """

    mode: str = "full"
    every: Optional[int] = None
    offload: bool = False
    block_classes: Optional[list[str]] = None

    def __post_init__(self) -> None:
        if self.mode not in _CHECKPOINT_MODES:
            raise ValueError(f"ActivationCheckpointingKwargs(mode={self.mode!r}); use one of {list(_CHECKPOINT_MODES)}")
        if self.mode == "every_k":
            if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 2:
                raise ValueError(f"ActivationCheckpointingKwargs(mode='every_k', every={self.every!r}); every must be a "
                                 "whole number >= 2 (every=1 is mode='full')")
        elif self.every is not None:
            raise ValueError(f"ActivationCheckpointingKwargs(every={self.every!r}) applies to mode='every_k' only, not "
                             f"mode={self.mode!r}; set mode='every_k' or drop every")
        if not isinstance(self.offload, bool):
            raise ValueError(f"ActivationCheckpointingKwargs(offload={self.offload!r}); use True or False")
        if isinstance(self.block_classes, str):
            self.block_classes = [n.strip() for n in self.block_classes.split(",") if n.strip()]


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradient accumulation behaves.

    num_steps: micro-steps per optimizer step. adjust_scheduler: count skipped scheduler steps.
    sync_with_dataloader: force a sync at the end of each dataloader. sync_each_batch: all-reduce
    gradients on every micro-step (saves memory, costs communication).
    """

    num_steps: Optional[int] = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders shard and place data.

    split_batches: the loader's batch size is the global one and is split across processes.
    dispatch_batches: rank 0 reads every batch and sends each rank its slice (default: True for
    iterable datasets, False otherwise). even_batches: pad the end so every rank gets the same
    number of batches. use_seedable_sampler: shuffle with a ``SeedableRandomSampler`` (order from
    ``data_seed`` + epoch, as Accelerate's); by default a shuffling loader keeps the plain DataLoader's
    order (process 0's draw, sharded), identical on every rank. data_seed: that sampler's seed
    (default: process 0's ``torch.initial_seed()``); no effect without use_seedable_sampler, as in
    Accelerate (a warning says so). non_blocking: asynchronous host-to-device copies.
    """

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    """Where a run writes its checkpoints and logs.

    ``staging_memory_limit`` (hasten's own; bytes, or a size such as ``"8GiB"``; default: the
    ``HASTEN_STAGING_MEMORY_LIMIT`` variable, else no limit) caps the host memory that
    ``save_state(blocking=False)`` keeps between saves for its copies of the state (page-locked when
    the state is on a GPU). What does not fit is copied into memory made for that save alone and
    freed once it is written, which is slower; a warning says so once. 0 keeps nothing.
    """

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    save_on_each_node: bool = False
    _: KW_ONLY  # hasten's own settings follow, so Accelerate's positional calls keep their meaning
    staging_memory_limit: Optional[Union[int, str]] = None

    def set_directories(self, project_dir: Optional[str] = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        if self.project_dir is not None:
            self.project_dir = os.fspath(self.project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(
                f"ProjectConfiguration(total_limit={self.total_limit}) would delete every checkpoint; "
                "use a positive number or None to keep all"
            )
        self.staging_memory_limit = _staging_limit(self.staging_memory_limit)


def _staging_limit(value: Any) -> Optional[int]:
    """``ProjectConfiguration.staging_memory_limit`` in bytes (None: no limit), else the variable's."""
    from .environment import get_env

    if value is not None:
        return staging_limit_bytes(value)
    raw = get_env("STAGING_MEMORY_LIMIT")
    if raw is None:
        return None
    return staging_limit_bytes(int(raw) if raw.strip().isdigit() else raw, "HASTEN_STAGING_MEMORY_LIMIT")


def staging_limit_bytes(value: Any, where: str = "ProjectConfiguration(staging_memory_limit=...)") -> int:
    """A staging memory limit in bytes, from an int or a size such as ``"8GiB"``; anything else
    (a negative number, a bool, an unreadable string) raises a ValueError naming ``where``."""
    if not isinstance(value, bool):
        from .device_map import convert_file_size_to_int

        try:
            return convert_file_size_to_int(value)
        except (ValueError, TypeError):
            pass
    raise ValueError(f"{where} = {value!r} is not a number of bytes: give an int >= 0 (0: keep no staging buffers "
                     "between saves) or a size such as '8GiB', or None for no limit")


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """Settings for ``torch.compile`` of prepared models.

    A field left at ``None`` is read from the launcher's ``HASTEN_DYNAMO_*`` (else
    ``ACCELERATE_DYNAMO_*``) variables: backend (default "no", which disables compilation), mode
    (default "default"), fullgraph, dynamic, use_regional_compilation. With
    ``use_regional_compilation`` each block of a ``ModuleList`` of identical blocks (the layers of a
    transformer) is compiled in place, so the compiler traces one block and reuses it for the others;
    the rest of the model is compiled piece by piece the same way.
    """

    backend: Any = None  # a name (str or DynamoBackend) or a backend callable
    mode: Optional[str] = None
    fullgraph: Optional[bool] = None
    dynamic: Optional[bool] = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: Optional[bool] = None

    def __post_init__(self) -> None:
        from .environment import get_env, parse_flag

        backend = self.backend if self.backend is not None else get_env("DYNAMO_BACKEND") or "no"
        if isinstance(backend, enum.Enum):
            backend = backend.value
        if isinstance(backend, str):  # a callable (a custom backend) is passed to torch.compile as is
            backend = backend.lower()
        self.backend = backend
        if self.mode is None:
            self.mode = get_env("DYNAMO_MODE") or "default"
        if self.fullgraph is None:
            self.fullgraph = parse_flag("DYNAMO_USE_FULLGRAPH")
        if self.dynamic is None and get_env("DYNAMO_USE_DYNAMIC") is not None:
            self.dynamic = parse_flag("DYNAMO_USE_DYNAMIC")
        if self.use_regional_compilation is None:
            self.use_regional_compilation = parse_flag("DYNAMO_USE_REGIONAL_COMPILATION")

    def to_kwargs(self) -> dict[str, Any]:
        kwargs = super().to_kwargs()
        kwargs.pop("use_regional_compilation", None)
        return kwargs

    def to_compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``torch.compile``."""
        kw: dict[str, Any] = {"backend": self.backend, "fullgraph": bool(self.fullgraph), "dynamic": self.dynamic}
        if self.mode not in (None, "default"):  # torch refuses a mode together with options
            kw["mode"] = self.mode
        if self.options is not None:
            kw["options"] = self.options
        return kw


class LoggerType(str, enum.Enum):
    """The experiment trackers ``Accelerator(log_with=...)`` knows by name ("all": every installed one)."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [member.value for member in cls]


_PROFILER_ACTIVITIES = ("cpu", "cuda", "xpu", "mtia", "hpu")
_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")


@dataclass
class ProfileKwargs(KwargsHandler):
    """Settings of ``accelerator.profile()`` (arguments of ``torch.profiler.profile``).

    activities: "cpu", "cuda", "xpu", "mtia", "hpu" (None: torch's default, CPU plus the
    accelerator in use). schedule_option: keys of ``torch.profiler.schedule`` (wait, warmup,
    active, repeat, skip_first); call ``prof.step()`` once per step when it is set.
    on_trace_ready: called with the profiler when a scheduled cycle is recorded.
    output_trace_dir: write one Chrome/Perfetto trace per process there (``profile_<rank>.json``).
    """

    activities: Optional[list[str]] = None
    schedule_option: Optional[dict[str, int]] = None
    on_trace_ready: Optional[Callable] = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: Optional[str] = None

    def __post_init__(self) -> None:
        for activity in self.activities or ():
            if str(activity).lower() not in _PROFILER_ACTIVITIES:
                raise ValueError(f"ProfileKwargs(activities=...) got {activity!r}; use some of {list(_PROFILER_ACTIVITIES)}")
        unknown = sorted(set(self.schedule_option or ()) - set(_SCHEDULE_KEYS))
        if unknown:
            raise ValueError(f"ProfileKwargs(schedule_option=...) has unknown key(s) {unknown}; use {list(_SCHEDULE_KEYS)}")

    def build(self) -> Any:
        """A ``torch.profiler.profile`` with these settings (not yet started)."""
        import torch

        activities = None
        if self.activities is not None:
            available = torch.profiler.supported_activities()
            activities = []
            for name in self.activities:
                kind = getattr(torch.profiler.ProfilerActivity, str(name).upper(), None)
                if kind is None or kind not in available:
                    raise ValueError(f"ProfileKwargs(activities=[{name!r}]): this machine cannot profile {name!r}; "
                                     f"available: {sorted(a.name.lower() for a in available)}")
                activities.append(kind)
        schedule = torch.profiler.schedule(**self.schedule_option) if self.schedule_option else None
        return torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes, profile_memory=self.profile_memory, with_stack=self.with_stack,
            with_flops=self.with_flops, with_modules=self.with_modules,
        )


Callback = Callable[..., Any]


# The fp8 recipes live in fp8_recipes.py; they stay importable from here, as in Accelerate.
_FP8_NAMES = ("FP8BackendType", "AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "FP8RecipeKwargs")


# Accelerate defines these in utils/dataclasses.py and scripts import them from there; hasten keeps
# each in its own module (the plugins, the fp8 recipes, the refused bitsandbytes config).
from .accelerate_paths import names_from_utils  # noqa: E402 - after the module's own names

__getattr__ = names_from_utils(__name__, (
    *_FP8_NAMES, "DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "TorchTensorParallelPlugin",
    "TorchTensorParallelConfig", "TorchContextParallelConfig", "BnbQuantizationConfig",
))
