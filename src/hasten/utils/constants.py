"""File names and lists that Accelerate exposes as constants, with Accelerate's values.

Scripts use them to find the files that ``save_model``/``save_pretrained`` write (``SAFE_WEIGHTS_NAME``
and the rest of the weights names are exactly what hasten writes too). hasten's ``save_state`` folders
have their own layout (docs/checkpoints.md): the optimizer, scheduler, sampler, scaler and RNG names
below are Accelerate's and only tell a script where Accelerate would have put those files.
"""

from ..files.weights import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME  # noqa: F401

SAFE_MODEL_NAME = "model"
MODEL_NAME = "pytorch_model"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"

# Oldest torch whose profiler handles these devices (Accelerate's gates; hasten needs a newer torch anyway).
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"
# Oldest versions Accelerate accepts for its beta parallelism modes (test suites skip below them).
BETA_TP_AVAILABLE_PYTORCH_VERSION = "2.3.0"
BETA_TP_AVAILABLE_TRANSFORMERS_VERSION = "4.52.0"
BETA_CP_AVAILABLE_PYTORCH_VERSION = "2.6.0"
BETA_SP_AVAILABLE_DEEPSPEED_VERSION = "0.18.2"

# The SageMaker images Accelerate's SageMaker config names by default (hasten does not launch on SageMaker;
# the names exist so that SageMaker configs can be read and written).
SAGEMAKER_PYTORCH_VERSION = "1.10.2"
SAGEMAKER_PYTHON_VERSION = "py38"
SAGEMAKER_TRANSFORMERS_VERSION = "4.17.0"
SAGEMAKER_PARALLEL_EC2_INSTANCES = ["ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4dn.24xlarge"]

# DistributedType names whose processes talk through torch.distributed.
# FSDP settings' accepted values, Accelerate's lists (transformers validates its FSDP arguments
# against the first two); the config file's schema checks against these too.
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]

TORCH_DISTRIBUTED_OPERATION_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP", "MULTI_NPU", "MULTI_MLU",
                                     "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_CPU", "MULTI_HPU", "MULTI_NEURON"]
# Options of torchrun (torch.distributed.run) that a launcher passes through unchanged.
TORCH_LAUNCH_PARAMS = ["nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
                       "standalone", "max_restarts", "monitor_interval", "start_method", "role", "module", "m",
                       "no_python", "run_path", "log_dir", "r", "redirects", "t", "tee", "node_rank", "master_addr",
                       "master_port"]

# -- big-model inference (names read lazily: they need torch, and this module must not import it) ----
_LAZY_TORCH_CONSTANTS = {"SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING": ("hasten.layerwise_casting", "CAST_LAYERS")}


def __getattr__(name: str) -> object:
    """``SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING``: the layer classes that layerwise casting stores coarsely."""
    if name in _LAZY_TORCH_CONSTANTS:
        import importlib

        module, attribute = _LAZY_TORCH_CONSTANTS[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
