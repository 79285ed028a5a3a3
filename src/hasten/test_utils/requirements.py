"""Accelerate's ``require_*`` test decorators, answered for hasten.

Each decorator skips the test (``unittest.skipUnless``, which pytest honours too) when the machine or
the installed packages cannot run it. Where hasten itself cannot do what the test needs (TPUs,
PiPPy, bitsandbytes, Gaudi/Ascend/... devices), the test is skipped whatever is installed, and the
reason says that it is hasten that lacks it, not the machine.
"""

from __future__ import annotations

import unittest
from functools import partial
from typing import Any, Callable, Optional

from ..utils import imports as _imports
from ..utils.compat import REFUSED
from ..utils.versions import compare_versions, is_torch_version
from .backend import device_count, torch_device

Decorator = Callable[[Any], Any]


def _skip_unless(condition: bool, reason: str) -> Decorator:
    return unittest.skipUnless(condition, reason)


def _needs_package(available: Callable[[], bool], package: str) -> Decorator:
    """A decorator that skips unless ``package`` is installed (asked when the decorator is made)."""

    def decorate(test_case: Any) -> Any:
        return unittest.skipUnless(available(), f"test requires {package}")(test_case)

    decorate.__name__ = f"require_{package}"
    decorate.__doc__ = f"Skip the test unless {package} is installed."
    return decorate


def _not_in_hasten(what: str) -> Decorator:
    """A decorator that always skips: hasten cannot run the test on any machine."""

    def decorate(test_case: Any) -> Any:
        return unittest.skip(f"test requires {what}, which hasten does not support")(test_case)

    decorate.__doc__ = f"Always skips: the test needs {what}, which hasten does not support."
    return decorate


def _cuda() -> bool:
    return torch_device == "cuda"


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def _xpu_count() -> int:
    import torch

    xpu = getattr(torch, "xpu", None)
    return xpu.device_count() if xpu is not None and xpu.is_available() else 0


def skip(test_case: Any) -> Any:
    """Skip the test always."""
    return unittest.skip("Test was skipped")(test_case)


def require_cpu(test_case: Any) -> Any:
    """Run only where hasten would train on the CPU (no GPU on the machine)."""
    return _skip_unless(torch_device == "cpu", "test requires only a CPU")(test_case)


def require_non_cpu(test_case: Any) -> Any:
    """Run only where hasten has an accelerator (CUDA, XPU or MPS)."""
    return _skip_unless(torch_device != "cpu", "test requires a GPU")(test_case)


def require_cuda(test_case: Any) -> Any:
    """Run only with a CUDA GPU."""
    return _skip_unless(_cuda(), "test requires a GPU")(test_case)


def require_cuda_or_hpu(test_case: Any) -> Any:
    """Run only with a CUDA GPU (hasten has no Gaudi support, so HPU does not count)."""
    return _skip_unless(_cuda(), "test requires a GPU (hasten does not support HPU)")(test_case)


def require_xpu(test_case: Any) -> Any:
    """Run only with an Intel XPU."""
    return _skip_unless(torch_device == "xpu", "test requires a XPU")(test_case)


def require_cuda_or_xpu(test_case: Any) -> Any:
    """Run only with a CUDA GPU or an Intel XPU."""
    return _skip_unless(torch_device in ("cuda", "xpu"), "test requires a CUDA GPU or XPU")(test_case)


def require_non_xpu(test_case: Any) -> Any:
    """Skip on an Intel XPU."""
    return _skip_unless(torch_device != "xpu", "test requires a non-XPU")(test_case)


def require_non_hpu(test_case: Any) -> Any:
    """Skip on Habana Gaudi; hasten never runs there, so this never skips."""
    return _skip_unless(torch_device != "hpu", "test requires a non-HPU")(test_case)


def require_non_torch_xla(test_case: Any) -> Any:
    """Skip under torch_xla; hasten never uses torch_xla, so this never skips."""
    return test_case


def require_fp16(test_case: Any) -> Any:
    """Run where fp16 mixed precision is supported (everywhere hasten runs)."""
    return _skip_unless(_imports.is_fp16_available(), "test requires FP16 support")(test_case)


def require_fp8(test_case: Any) -> Any:
    """Run where hasten can train in fp8: an fp8 engine installed and, on CUDA, a GPU with fp8 units
    (on CPU torch emulates the float8 matmuls)."""
    from ..utils.env_compat import check_cuda_fp8_capability

    usable = _imports.is_fp8_available() and (not _cuda() or check_cuda_fp8_capability())
    return _skip_unless(usable, "test requires FP8 support")(test_case)


def require_fsdp2(test_case: Any) -> Any:
    """Run where FSDP2 exists (torch 2.5 or newer)."""
    return _skip_unless(is_torch_version(">=", "2.5.0"), "test requires FSDP2 (torch >= 2.5.0)")(test_case)


def require_fsdp(test_case: Any) -> Any:
    """Run where FSDP exists (torch 2.5 or newer, for FSDP2)."""
    return require_fsdp2(test_case)


def require_mps(test_case: Any) -> Any:
    """Run only with Apple's MPS device."""
    return _skip_unless(torch_device == "mps", "test requires a `mps` backend support in `torch`")(test_case)


require_mlu = _not_in_hasten("a Cambricon MLU")
require_sdaa = _not_in_hasten("a Tecorigin SDAA")
require_musa = _not_in_hasten("a Moore Threads MUSA GPU")
require_npu = _not_in_hasten("an Ascend NPU")
require_neuron = _not_in_hasten("AWS Neuron cores")
require_tpu = _not_in_hasten("a TPU (torch_xla)")
require_pippy = _not_in_hasten("PiPPy (pipeline-parallel inference)")
require_bnb = _not_in_hasten("bitsandbytes")
require_pippy.__doc__ += " " + REFUSED["prepare_pippy"]
require_bnb.__doc__ += " " + REFUSED["BnbQuantizationConfig"]


def require_huggingface_suite(test_case: Any) -> Any:
    """Run where transformers and datasets are both installed."""
    both = _imports.is_transformers_available() and _imports.is_datasets_available()
    return _skip_unless(both, "test requires the Hugging Face suite")(test_case)


require_datasets = _needs_package(_imports.is_datasets_available, "datasets")
require_transformers = _needs_package(_imports.is_transformers_available, "transformers")
require_timm = _needs_package(_imports.is_timm_available, "timm")
require_torchvision = _needs_package(_imports.is_torchvision_available, "torchvision")
require_triton = _needs_package(_imports.is_triton_available, "triton")
require_schedulefree = _needs_package(_imports.is_schedulefree_available, "schedulefree")
require_peft = _needs_package(_imports.is_peft_available, "peft")
require_deepspeed = _needs_package(_imports.is_deepspeed_available, "deepspeed")
require_tensorboard = _needs_package(_imports.is_tensorboard_available, "tensorboard")
require_wandb = _needs_package(_imports.is_wandb_available, "wandb")
require_trackio = _needs_package(_imports.is_trackio_available, "trackio")
require_comet_ml = _needs_package(_imports.is_comet_ml_available, "comet_ml")
require_aim = _needs_package(_imports.is_aim_available, "aim")
require_clearml = _needs_package(_imports.is_clearml_available, "clearml")
require_dvclive = _needs_package(_imports.is_dvclive_available, "dvclive")
require_swanlab = _needs_package(_imports.is_swanlab_available, "swanlab")
require_pandas = _needs_package(_imports.is_pandas_available, "pandas")
require_mlflow = _needs_package(_imports.is_mlflow_available, "mlflow")
require_import_timer = _needs_package(_imports.is_import_timer_available, "tuna")
require_transformer_engine = _needs_package(_imports.is_transformer_engine_available, "transformer_engine")
require_torchao = _needs_package(_imports.is_torchao_available, "torchao")
require_matplotlib = _needs_package(_imports.is_matplotlib_available, "matplotlib")
require_torchdata_stateful_dataloader = _needs_package(
    _imports.is_torchdata_stateful_dataloader_available, "torchdata.stateful_dataloader")


def require_transformer_engine_mxfp8(test_case: Any) -> Any:
    """Run where Transformer Engine's MXFP8 block scaling works (a GPU of compute capability 10+)."""
    usable = _imports.is_transformer_engine_mxfp8_available()
    return _skip_unless(usable, "test requires transformers engine MXFP8 block scaling")(test_case)


def require_tp(test_case: Any) -> Any:
    """Run where tensor parallelism works: torch 2.3+ and transformers 4.52+."""
    usable = (is_torch_version(">=", "2.3.0") and _imports.is_transformers_available()
              and compare_versions("transformers", ">=", "4.52.0"))
    return _skip_unless(usable, "test requires torch version >= 2.3.0 and transformers version >= 4.52.0")(test_case)


def require_trackers(test_case: Any) -> Any:
    """Run where at least one of wandb, tensorboard, trackio, swanlab is installed and comet_ml is not."""
    some = any(check() for check in (_imports.is_wandb_available, _imports.is_tensorboard_available,
                                     _imports.is_trackio_available, _imports.is_swanlab_available))
    return _skip_unless(some and not _imports.is_comet_ml_available(),
                        "test requires at least one tracker to be available and for `comet_ml` to not be installed"
                        )(test_case)


def require_single_device(test_case: Any) -> Any:
    """Run with exactly one accelerator device."""
    return _skip_unless(torch_device != "cpu" and device_count == 1,
                        "test requires a single device accelerator")(test_case)


def require_single_gpu(test_case: Any) -> Any:
    """Run with exactly one CUDA GPU."""
    return _skip_unless(_cuda_count() == 1, "test requires a GPU")(test_case)


def require_single_xpu(test_case: Any) -> Any:
    """Run with exactly one XPU."""
    return _skip_unless(_xpu_count() == 1, "test requires a XPU")(test_case)


def require_multi_device(test_case: Any) -> Any:
    """Run with two or more accelerator devices."""
    return _skip_unless(device_count > 1, "test requires multiple hardware accelerators")(test_case)


def require_multi_gpu(test_case: Any) -> Any:
    """Run with two or more CUDA GPUs."""
    return _skip_unless(_cuda_count() > 1, "test requires multiple GPUs")(test_case)


def require_multi_xpu(test_case: Any) -> Any:
    """Run with two or more XPUs."""
    return _skip_unless(_xpu_count() > 1, "test requires multiple XPUs")(test_case)


def require_multi_gpu_or_xpu(test_case: Any) -> Any:
    """Run with two or more CUDA GPUs or XPUs."""
    return _skip_unless(torch_device in ("cuda", "xpu") and device_count > 1,
                        "test requires multiple GPUs or XPUs")(test_case)


def require_torch_min_version(test_case: Any = None, version: Optional[str] = None) -> Any:
    """Run with torch ``version`` or newer; ``@require_torch_min_version(version="2.4")`` also works."""
    if version is None:
        raise ValueError("require_torch_min_version needs version=, e.g. @require_torch_min_version(version='2.4')")
    if test_case is None:
        return partial(require_torch_min_version, version=version)
    return _skip_unless(is_torch_version(">=", version), f"test requires torch version >= {version}")(test_case)
