"""Public helpers (``hasten.utils.*``), loaded on first use."""

from .._lazy import lazy_module

_EXPORTS = {
    # configuration objects
    **{name: ".dataclasses" for name in (
        "DistributedType", "PrecisionType", "RNGType", "DDPCommunicationHookType", "KwargsHandler",
        "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs",
        "GradientAccumulationPlugin", "DataLoaderConfiguration", "ProjectConfiguration", "TorchDynamoPlugin",
    )},
    # collectives and nested-structure helpers
    **{name: ".operations" for name in (
        "gather", "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes",
        "send_to_device", "recursively_apply", "concatenate", "find_batch_size", "convert_outputs_to_fp32",
        "DistributedOperationException", "convert_to_fp32", "ConvertOutputsToFp32", "find_device", "slice_tensors",
        "listify", "ignorant_find_batch_size", "honor_type", "is_namedtuple", "is_torch_tensor",
        "CannotPadNestedTensorWarning",
    )},
    **{name: ".random" for name in ("set_seed", "synchronize_rng_state", "synchronize_rng_states")},
    **{name: ".memory" for name in (
        "find_executable_batch_size", "release_memory", "clear_device_cache", "should_reduce_batch_size",
    )},
    "tqdm": ".tqdm",
    "FullyShardedDataParallelPlugin": ".fsdp_plugin",
    "DeepSpeedPlugin": ".deepspeed_plugin",
    **{name: ".deepspeed" for name in ("DummyOptim", "DummyScheduler")},
    **{name: ".environment" for name in ("get_env", "parse_flag", "parse_int", "parse_choice")},
    **{name: "..saving" for name in ("save", "load_checkpoint_in_model")},
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_module(__name__, _EXPORTS)
