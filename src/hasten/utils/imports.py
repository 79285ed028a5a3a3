"""``is_*_available``: cheap questions about optional packages and devices (Accelerate's names).

Package checks look for the package with ``importlib.util.find_spec`` and its installed
metadata; they never import it (importing wandb or deepspeed takes seconds and can have side
effects). Device checks import torch when called, never when this module is imported, so that
``import hasten`` stays free of torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from functools import lru_cache
from typing import Callable, Optional

from .environment import parse_flag


def _version_tuple(text: str) -> tuple[int, ...]:
    # "2.13.0+cpu" -> (2, 13, 0); pre-release tags count as the release (good enough for minimums).
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


@lru_cache(maxsize=None)
def _installed_version(*distributions: str) -> Optional[str]:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@lru_cache(maxsize=None)
def _has_module(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a broken __spec__
        return False


def _is_package_available(module: str, *distributions: str, min_version: Optional[str] = None,
                          below_version: Optional[str] = None) -> bool:
    """True when ``module`` can be imported and (if metadata exists) its version is in range.

    A folder named like the package on ``sys.path`` (a namespace package without metadata) is not
    an installation: the distribution's metadata is required, under ``distributions`` or ``module``.
    """
    if not _has_module(module):
        return False
    version = _installed_version(*(distributions or (module,)))
    if version is None:
        return False
    if min_version is not None and _version_tuple(version) < _version_tuple(min_version):
        return False
    if below_version is not None and _version_tuple(version) >= _version_tuple(below_version):
        return False
    return True


def _package_check(name: str, module: str, *distributions: str, **versions: str) -> Callable[[], bool]:
    def check() -> bool:
        return _is_package_available(module, *distributions, **versions)

    check.__name__ = check.__qualname__ = name
    check.__doc__ = f"Whether the optional package ``{module}`` is installed (checked without importing it)."
    return check


# -- packages -----------------------------------------------------------------------------------
is_aim_available = _package_check("is_aim_available", "aim", below_version="4.0.0")
is_amdsmi_available = _package_check("is_amdsmi_available", "amdsmi")
is_boto3_available = _package_check("is_boto3_available", "boto3")
is_clearml_available = _package_check("is_clearml_available", "clearml")
is_comet_ml_available = _package_check("is_comet_ml_available", "comet_ml", "comet-ml", "comet_ml")
is_datasets_available = _package_check("is_datasets_available", "datasets")
is_deepspeed_available = _package_check("is_deepspeed_available", "deepspeed")
is_dvclive_available = _package_check("is_dvclive_available", "dvclive")
is_import_timer_available = _package_check("is_import_timer_available", "import_timer", "import-timer", "import_timer")
is_lomo_available = _package_check("is_lomo_available", "lomo_optim", "lomo-optim", "lomo_optim")
is_matplotlib_available = _package_check("is_matplotlib_available", "matplotlib")
is_msamp_available = _package_check("is_msamp_available", "msamp", "ms-amp", "msamp")
is_pandas_available = _package_check("is_pandas_available", "pandas")
is_peft_available = _package_check("is_peft_available", "peft")
is_pynvml_available = _package_check("is_pynvml_available", "pynvml", "nvidia-ml-py", "pynvml")
is_pytest_available = _package_check("is_pytest_available", "pytest")
is_sagemaker_available = _package_check("is_sagemaker_available", "sagemaker")
is_schedulefree_available = _package_check("is_schedulefree_available", "schedulefree")
is_swanlab_available = _package_check("is_swanlab_available", "swanlab")
is_timm_available = _package_check("is_timm_available", "timm")
is_torchao_available = _package_check("is_torchao_available", "torchao", min_version="0.6.1")
is_torchdata_available = _package_check("is_torchdata_available", "torchdata")
is_torchdata_stateful_dataloader_available = _package_check(
    "is_torchdata_stateful_dataloader_available", "torchdata", min_version="0.8.0")
is_torchvision_available = _package_check("is_torchvision_available", "torchvision")
is_tqdm_available = _package_check("is_tqdm_available", "tqdm")
is_transformer_engine_available = _package_check(
    "is_transformer_engine_available", "transformer_engine", "transformer-engine", "transformer_engine")
is_transformers_available = _package_check("is_transformers_available", "transformers")
is_triton_available = _package_check("is_triton_available", "triton", "triton", "pytorch-triton", "triton-xpu")
is_wandb_available = _package_check("is_wandb_available", "wandb")
is_4bit_bnb_available = _package_check("is_4bit_bnb_available", "bitsandbytes", min_version="0.39.0")
is_8bit_bnb_available = _package_check("is_8bit_bnb_available", "bitsandbytes", min_version="0.37.2")


def is_bnb_available(min_version: Optional[str] = None) -> bool:
    """Whether bitsandbytes is installed (at least ``min_version`` when given)."""
    return _is_package_available("bitsandbytes", min_version=min_version)


def is_bitsandbytes_multi_backend_available() -> bool:
    """Whether the installed bitsandbytes advertises its multi-backend feature (imports it)."""
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_tensorboard_available() -> bool:
    """Whether tensorboard (or tensorboardX) is installed."""
    return _is_package_available("tensorboard") or _is_package_available("tensorboardX")


def is_mlflow_available() -> bool:
    """Whether mlflow (or its lighter ``mlflow-skinny`` distribution) is installed."""
    return _is_package_available("mlflow", "mlflow", "mlflow-skinny")


def is_trackio_available() -> bool:
    """Whether trackio is installed (it needs Python 3.10 or newer)."""
    return sys.version_info >= (3, 10) and _is_package_available("trackio")


def is_rich_available() -> bool:
    """Whether rich is installed *and* asked for (``HASTEN_ENABLE_RICH`` / ``ACCELERATE_ENABLE_RICH``)."""
    return _is_package_available("rich") and parse_flag("ENABLE_RICH")


def is_megatron_lm_available() -> bool:
    """Whether Megatron-LM is installed and enabled with ``HASTEN_USE_MEGATRON_LM=1``."""
    return parse_flag("USE_MEGATRON_LM") and _has_module("megatron")


def is_fp8_available() -> bool:
    """Whether an fp8 engine (transformer-engine, torchao or MS-AMP) is installed."""
    return is_transformer_engine_available() or is_torchao_available() or is_msamp_available()


def is_transformer_engine_mxfp8_available() -> bool:
    """Whether transformer-engine is installed and the GPU supports MXFP8 (compute capability 10+)."""
    if not is_transformer_engine_available() or not is_cuda_available():
        return False
    import torch

    return torch.cuda.get_device_capability()[0] >= 10


# -- torch features -----------------------------------------------------------------------------
def is_weights_only_available() -> bool:
    """Whether ``torch.load`` accepts ``weights_only`` (torch >= 2.4; hasten requires 2.7)."""
    version = _installed_version("torch")
    return version is not None and _version_tuple(version) >= (2, 4)


def is_pippy_available() -> bool:
    """Whether ``torch.distributed.pipelining`` exists (torch >= 2.4)."""
    return is_weights_only_available()


def is_xccl_available() -> bool:
    """Whether torch.distributed was built with the XCCL backend (Intel GPUs)."""
    import torch.distributed

    check = getattr(torch.distributed.distributed_c10d, "is_xccl_available", None)
    return bool(check and check())


# -- devices (these import torch when called) ----------------------------------------------------
def is_cuda_available() -> bool:
    """Whether a CUDA (or ROCm) GPU is usable, asked through NVML so CUDA is not initialised."""
    import torch

    from .environment import patch_environment

    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        return torch.cuda.is_available()


def is_rocm_available() -> bool:
    """Whether torch is a ROCm build and sees an AMD GPU."""
    import torch

    return torch.version.hip is not None and is_cuda_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS device is built and usable (with torch at least ``min_version``)."""
    import torch

    if _version_tuple(torch.__version__) < _version_tuple(min_version):
        return False
    return torch.backends.mps.is_available() and torch.backends.mps.is_built()


def is_xpu_available(check_device: bool = False) -> bool:
    """Whether an Intel XPU is usable through stock torch (2.7 or newer)."""
    import torch

    if _version_tuple(torch.__version__) < (2, 7) or not hasattr(torch, "xpu"):
        return False
    try:
        if check_device:
            torch.xpu.device_count()  # raises when no device is present
        return torch.xpu.is_available()
    except RuntimeError:
        return False


def _plugin_device(extension: str, attribute: str, check_device: bool) -> bool:
    # Out-of-tree backends register their device module on torch only once imported.
    if not _has_module(extension):
        return False
    try:
        importlib.import_module(extension)
        import torch

        module = getattr(torch, attribute, None)
        if module is None:
            return False
        if check_device:
            module.device_count()
        return bool(module.is_available())
    except Exception:  # a backend without its driver fails in many ways; it is simply absent
        return False


def is_npu_available(check_device: bool = False) -> bool:
    """Whether ``torch_npu`` is installed and (with ``check_device``) an Ascend NPU is present."""
    return _plugin_device("torch_npu", "npu", check_device)


def is_mlu_available(check_device: bool = False) -> bool:
    """Whether ``torch_mlu`` is installed and a Cambricon MLU is present."""
    return _plugin_device("torch_mlu", "mlu", check_device)


def is_musa_available(check_device: bool = False) -> bool:
    """Whether ``torch_musa`` is installed and a Moore Threads GPU is present."""
    return _plugin_device("torch_musa", "musa", check_device)


def is_sdaa_available(check_device: bool = False) -> bool:
    """Whether ``torch_sdaa`` is installed and an SDAA device is present."""
    return _plugin_device("torch_sdaa", "sdaa", check_device)


def is_neuron_available(check_device: bool = False) -> bool:
    """Whether ``torch_neuronx`` is installed and an AWS Neuron device is present."""
    return _plugin_device("torch_neuronx", "neuron", check_device)


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether Habana's ``habana_frameworks.torch`` is installed and an HPU is present."""
    if not _has_module("habana_frameworks"):
        return False
    if init_hccl:
        try:
            importlib.import_module("habana_frameworks.torch.distributed.hccl")
        except Exception:
            return False
    return _plugin_device("habana_frameworks.torch", "hpu", False)


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch_xla is installed (``USE_TORCH_XLA=0`` hides it); optionally on a TPU or GPU."""
    if check_is_tpu and check_is_gpu:
        raise ValueError("is_torch_xla_available: pass check_is_tpu or check_is_gpu, not both")
    # Like Accelerate, the plain ``USE_TORCH_XLA`` variable (not prefixed) turns torch_xla off.
    if not _has_module("torch_xla") or os.environ.get("USE_TORCH_XLA", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    import torch_xla.runtime

    kind = torch_xla.runtime.device_type()
    return kind in ("GPU", "CUDA") if check_is_gpu else kind == "TPU"


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 compute is supported on the device this process would use (CPU: yes)."""
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    import torch

    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    if is_mps_available():
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def is_fp16_available() -> bool:
    """Whether fp16 is supported (everywhere except first-generation Habana Gaudi)."""
    return True


# Accelerate has these names in this module; hasten keeps them elsewhere (see accelerate_paths).
from .accelerate_paths import names_from_utils  # noqa: E402 - after the module's own names

__getattr__ = names_from_utils(__name__, (
    "is_habana_gaudi1", "torchao_required", "deepspeed_required",
))
