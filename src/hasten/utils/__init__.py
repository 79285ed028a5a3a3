"""Public helpers (``hasten.utils.*``), loaded on first use."""

from .._lazy import lazy_module

_EXPORTS = {
    # configuration objects
    **{name: ".dataclasses" for name in (
        "DistributedType", "PrecisionType", "RNGType", "DDPCommunicationHookType", "KwargsHandler",
        "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs",
        "GradientAccumulationPlugin", "DataLoaderConfiguration", "ProjectConfiguration", "TorchDynamoPlugin",
        "DynamoBackend",
        "LoggerType", "ProfileKwargs",
    )},
    **{name: ".fp8_recipes" for name in (
        "AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "FP8RecipeKwargs", "FP8BackendType",
    )},
    # collectives and nested-structure helpers
    **{name: ".operations" for name in (
        "gather", "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes",
        "send_to_device", "recursively_apply", "concatenate", "find_batch_size", "convert_outputs_to_fp32",
        "DistributedOperationException", "convert_to_fp32", "ConvertOutputsToFp32", "find_device", "slice_tensors",
        "listify", "ignorant_find_batch_size", "honor_type", "is_namedtuple", "is_torch_tensor",
        "CannotPadNestedTensorWarning", "copy_tensor_to_devices",
    )},
    **{name: ".random" for name in ("set_seed", "synchronize_rng_state", "synchronize_rng_states")},
    **{name: ".memory" for name in (
        "find_executable_batch_size", "release_memory", "clear_device_cache", "should_reduce_batch_size",
    )},
    "tqdm": ".tqdm",
    "FullyShardedDataParallelPlugin": ".fsdp_plugin",
    "DeepSpeedPlugin": ".deepspeed_plugin",
    "ParallelismConfig": ".parallelism_config",
    **{name: ".environment" for name in (
        "get_env", "parse_flag", "parse_int", "parse_choice", "patch_environment", "clear_environment",
    )},
    # optional packages and devices, checked without importing them
    **{name: ".imports" for name in (
        "is_4bit_bnb_available", "is_8bit_bnb_available", "is_aim_available", "is_amdsmi_available",
        "is_bf16_available", "is_bitsandbytes_multi_backend_available", "is_bnb_available", "is_boto3_available",
        "is_clearml_available", "is_comet_ml_available", "is_cuda_available", "is_datasets_available",
        "is_deepspeed_available", "is_dvclive_available", "is_fp16_available", "is_fp8_available",
        "is_hpu_available", "is_import_timer_available", "is_lomo_available", "is_matplotlib_available",
        "is_megatron_lm_available", "is_mlflow_available", "is_mlu_available", "is_mps_available",
        "is_msamp_available", "is_musa_available", "is_neuron_available", "is_npu_available", "is_pandas_available",
        "is_peft_available", "is_pippy_available", "is_pynvml_available", "is_pytest_available", "is_rich_available",
        "is_rocm_available", "is_sagemaker_available", "is_schedulefree_available", "is_sdaa_available",
        "is_swanlab_available", "is_tensorboard_available", "is_timm_available", "is_torch_xla_available",
        "is_torchao_available", "is_torchdata_available", "is_torchdata_stateful_dataloader_available",
        "is_torchvision_available", "is_tqdm_available", "is_trackio_available", "is_transformer_engine_available",
        "is_transformer_engine_mxfp8_available", "is_transformers_available", "is_triton_available",
        "is_wandb_available", "is_weights_only_available", "is_xccl_available", "is_xpu_available",
    )},
    **{name: ".deepspeed" for name in ("DummyOptim", "DummyScheduler")},
    "write_basic_config": "..commands.config",
    "save": "..saving",
    "load_checkpoint_in_model": "..model_loading",
    # big-model inference
    **{name: ".modeling" for name in ("compute_module_sizes", "set_module_tensor_to_device", "find_tied_parameters")},
    **{name: ".device_map" for name in ("get_max_memory", "get_balanced_memory", "infer_auto_device_map")},
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_module(__name__, _EXPORTS)
