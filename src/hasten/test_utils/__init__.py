"""Helpers for testing code that uses hasten: Accelerate's ``accelerate.test_utils`` names.

    from hasten.test_utils import RegressionDataset, RegressionModel, require_cpu, slow
    from hasten.test_utils.testing import AccelerateTestCase, get_launch_command

Nothing here is imported by ``import hasten``; the names load on first use. The scripts that
Accelerate's own tests launch are in ``scripts/`` (``path_in_hasten_package("test_utils", "scripts",
"test_script.py")``); ``test_script``, ``test_sync`` and ``test_ops`` are importable from here too,
for ``debug_launcher(test_script.main)``.
"""

import importlib
from typing import Any

_EXPORTS = {
    **dict.fromkeys(("DEFAULT_LAUNCH_COMMAND", "AccelerateTestCase", "MockingTestCase", "TempDirTestCase",
        "SubprocessCallException", "are_the_same_tensors", "assert_exception", "capture_call_output",
        "execute_subprocess_async", "get_launch_command", "get_torch_dist_unique_port", "parse_flag_from_env",
        "path_in_accelerate_package", "path_in_hasten_package", "pytest_xdist_worker_id", "run_command",
        "run_first", "slow"), ".testing"),
    **dict.fromkeys(("require_aim", "require_bnb", "require_clearml", "require_comet_ml", "require_cpu",
        "require_cuda", "require_cuda_or_hpu", "require_cuda_or_xpu", "require_datasets", "require_deepspeed",
        "require_dvclive", "require_fp16", "require_fp8", "require_fsdp", "require_fsdp2",
        "require_huggingface_suite", "require_import_timer", "require_matplotlib", "require_mlflow", "require_mlu",
        "require_mps", "require_multi_device", "require_multi_gpu", "require_multi_gpu_or_xpu",
        "require_multi_xpu", "require_musa", "require_neuron", "require_non_cpu", "require_non_hpu",
        "require_non_torch_xla", "require_non_xpu", "require_npu", "require_pandas", "require_peft",
        "require_pippy", "require_schedulefree", "require_sdaa", "require_single_device", "require_single_gpu",
        "require_single_xpu", "require_swanlab", "require_tensorboard", "require_timm",
        "require_torch_min_version", "require_torchao", "require_torchdata_stateful_dataloader",
        "require_torchvision", "require_tp", "require_tpu", "require_trackers", "require_trackio",
        "require_transformer_engine", "require_transformer_engine_mxfp8", "require_transformers", "require_triton",
        "require_wandb", "require_xpu", "skip"), ".testing"),
    **dict.fromkeys(("device_count", "torch_device", "memory_allocated_func", "get_backend"), ".backend"),
    **dict.fromkeys(("RegressionDataset", "RegressionModel", "RegressionModel4XPU"), ".training"),
    "compare_against_test": ".examples",
}
_SCRIPTS = ("test_script", "test_sync", "test_ops")  # modules of scripts/
__all__ = sorted([*_EXPORTS, *_SCRIPTS])


def __getattr__(name: str) -> Any:
    if name in _SCRIPTS:
        return importlib.import_module(f".scripts.{name}", __name__)
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


def __dir__() -> list:
    return __all__
