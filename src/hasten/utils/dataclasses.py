"""Configuration objects of the public API (same names and fields as Accelerate's).

Torch is imported lazily here so that the CLI can use the enums without paying for it.
"""

from __future__ import annotations

import enum
import os
from dataclasses import KW_ONLY, dataclass, field, fields
from datetime import timedelta
from typing import Any, Callable, Optional, Union


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


class KwargsHandler:
    """Base of the ``kwargs_handlers`` given to ``Accelerator``: only non-default fields count."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the default."""
        default = self.__class__()
        return {k: v for k, v in self.to_dict().items() if getattr(default, k) != v}


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
    number of batches. use_seedable_sampler: accepted for compatibility and ignored: hasten's shuffling
    is always reproducible and identical on every rank. data_seed: seed of the shuffle (default: agreed
    across ranks at prepare time). non_blocking: asynchronous host-to-device copies.
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
    """Where a run writes its checkpoints and logs."""

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    save_on_each_node: bool = False

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


class FP8BackendType(str, enum.Enum):
    """The library that runs fp8 training: torchao (AO), Transformer Engine (TE) or MS-AMP."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


def _fp8_choice(owner: str, name: str, value: Optional[str], env: str, default: str, choices: tuple[str, ...],
                upper: bool = True) -> str:
    from .environment import get_env

    if value is None:
        value = get_env(env) or default
    text = str(value).strip()
    text = text.upper() if upper else text.lower()
    if text not in choices:
        raise ValueError(f"{owner}({name}={value!r}) is not valid; use one of {', '.join(choices)}")
    return text


def _fp8_int(owner: str, name: str, value: Optional[int], env: str, default: int, minimum: int) -> int:
    from .environment import parse_int

    if value is None:
        value = parse_int(env, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}({name}={value!r}) is not valid; use a whole number >= {minimum}")
    return value


@dataclass
class AORecipeKwargs(KwargsHandler):
    """fp8 training with torchao (``torchao.float8.convert_to_float8_training``).

    Args:
        config: a ``torchao.float8.Float8LinearConfig``, or a recipe name ("tensorwise", "rowwise",
            "rowwise_with_gw_hp"); None builds one from the two flags below.
        module_filter_func: ``fn(module, fqn) -> bool``, True to convert that layer. Default: every
            ``nn.Linear`` except the first, the last, and those with a dimension not a multiple of 16.
        pad_inner_dim: pad matmul dimensions to multiples of 16 (default True; ``HASTEN_FP8_PAD_INNER_DIM``).
        enable_fsdp_float8_all_gather: all-gather FSDP2 shards in float8 (default True;
            ``HASTEN_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER``); ignored without FSDP2.

    Needs torchao (``pip install torchao``); constructing the object without it raises ImportError.
    """

    config: Any = None
    module_filter_func: Optional[Callable] = None
    pad_inner_dim: Optional[bool] = None
    enable_fsdp_float8_all_gather: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.module_filter_func is not None and not callable(self.module_filter_func):
            raise TypeError(f"AORecipeKwargs(module_filter_func={self.module_filter_func!r}) is not callable; pass "
                            "a function (module, fqn) -> bool, or None for the default filter")
        from ..fp8 import build_ao_config

        self.config = build_ao_config(self.config, self.pad_inner_dim, self.enable_fsdp_float8_all_gather)
        self.pad_inner_dim = self.config.pad_inner_dim
        self.enable_fsdp_float8_all_gather = self.config.enable_fsdp_float8_all_gather


@dataclass
class TERecipeKwargs(KwargsHandler):
    """fp8 training with NVIDIA Transformer Engine (fields as in Accelerate; each default can come
    from ``HASTEN_FP8_<FIELD>``, e.g. ``HASTEN_FP8_FORMAT``). Needs transformer_engine and CUDA."""

    use_autocast_during_eval: Optional[bool] = None
    margin: Optional[int] = None
    interval: Optional[int] = None
    fp8_format: Optional[str] = None
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[str] = None
    override_linear_precision: Optional[tuple[bool, bool, bool]] = None
    use_mxfp8_block_scaling: Optional[bool] = None

    def __post_init__(self) -> None:
        self._check_te_fields("TERecipeKwargs")
        from ..fp8 import require_backend

        require_backend("TE", "TERecipeKwargs")

    def _check_te_fields(self, owner: str) -> None:
        from .environment import get_env, parse_flag

        if self.use_autocast_during_eval is None:
            self.use_autocast_during_eval = parse_flag("FP8_USE_AUTOCAST_DURING_EVAL")
        self.margin = _fp8_int(owner, "margin", self.margin, "FP8_MARGIN", 0, 0)
        self.interval = _fp8_int(owner, "interval", self.interval, "FP8_INTERVAL", 1, 1)
        self.fp8_format = _fp8_choice(owner, "fp8_format", self.fp8_format, "FP8_FORMAT", "HYBRID",
                                      ("HYBRID", "E4M3", "E5M2"))
        self.amax_history_len = _fp8_int(owner, "amax_history_len", self.amax_history_len,
                                         "FP8_AMAX_HISTORY_LEN", 1024, 1)
        self.amax_compute_algo = _fp8_choice(owner, "amax_compute_algo", self.amax_compute_algo,
                                             "FP8_AMAX_COMPUTE_ALGO", "most_recent", ("max", "most_recent"), upper=False)
        if self.override_linear_precision is None:
            joined = get_env("FP8_OVERRIDE_LINEAR_PRECISION")  # what hasten launch passes
            if joined:
                from .environment import _FALSE, _TRUE

                words = [v.strip().lower() for v in joined.split(",")]
                self.override_linear_precision = tuple(w in _TRUE if w in _TRUE | _FALSE else w for w in words)
            else:
                self.override_linear_precision = tuple(
                    parse_flag(f"FP8_OVERRIDE_{gemm}") for gemm in ("FPROP", "DGRAD", "WGRAD"))
        value = self.override_linear_precision
        if not isinstance(value, (tuple, list)) or len(value) != 3 or not all(isinstance(v, bool) for v in value):
            raise ValueError(f"{owner}(override_linear_precision={value!r}) is not valid; use three booleans "
                             "(fprop, dgrad, wgrad), e.g. (False, False, True)")
        self.override_linear_precision = tuple(value)
        if self.use_mxfp8_block_scaling is None:
            self.use_mxfp8_block_scaling = parse_flag("FP8_USE_MXFP8_BLOCK_SCALING")


@dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """fp8 training with MS-AMP. ``opt_level``: "O1" or "O2" (default; ``HASTEN_FP8_OPT_LEVEL``).
    Needs msamp and CUDA."""

    opt_level: Optional[str] = None

    def __post_init__(self) -> None:
        self._check_msamp_fields("MSAMPRecipeKwargs")
        from ..fp8 import require_backend

        require_backend("MSAMP", "MSAMPRecipeKwargs")

    def _check_msamp_fields(self, owner: str) -> None:
        self.opt_level = _fp8_choice(owner, "opt_level", self.opt_level, "FP8_OPT_LEVEL", "O2", ("O1", "O2"))


@dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Deprecated (as in Accelerate): use ``AORecipeKwargs``, ``TERecipeKwargs`` or ``MSAMPRecipeKwargs``.

    ``backend``: "TE", "MSAMP" or (hasten only) "AO"; default ``HASTEN_FP8_BACKEND``, else MS-AMP
    when installed, else TE. The Accelerator uses the recipe of that backend (``to_recipe()``).
    """

    backend: Optional[str] = None

    def __post_init__(self) -> None:
        import warnings

        warnings.warn("FP8RecipeKwargs is deprecated; use AORecipeKwargs (torchao), TERecipeKwargs or "
                      "MSAMPRecipeKwargs", FutureWarning, stacklevel=3)
        from ..fp8 import backend_installed, require_backend

        default = "MSAMP" if backend_installed("MSAMP") else "TE"
        self.backend = _fp8_choice("FP8RecipeKwargs", "backend", self.backend, "FP8_BACKEND", default,
                                   ("AO", "TE", "MSAMP"))
        if self.backend == "TE":
            self._check_te_fields("FP8RecipeKwargs")
        elif self.backend == "MSAMP":
            self._check_msamp_fields("FP8RecipeKwargs")
        require_backend(self.backend, f"FP8RecipeKwargs(backend={self.backend!r})")

    def to_recipe(self) -> KwargsHandler:
        """The recipe handler of ``backend`` with this object's settings."""
        if self.backend == "AO":
            return AORecipeKwargs()
        if self.backend == "MSAMP":
            return MSAMPRecipeKwargs(opt_level=self.opt_level)
        names = [f.name for f in fields(TERecipeKwargs)]
        return TERecipeKwargs(**{n: getattr(self, n) for n in names})

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


# Kwargs handlers that the Accelerator accepts, by class.
KWARGS_HANDLERS: tuple[type, ...] = (
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    AutocastKwargs,
    AORecipeKwargs,
    FP8RecipeKwargs,  # before its base classes, so that it is recognised as itself
    TERecipeKwargs,
    MSAMPRecipeKwargs,
    ProfileKwargs,
)

Callback = Callable[..., Any]
