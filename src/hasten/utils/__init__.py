"""Public helpers (``hasten.utils.*``), loaded on first use."""

from .._lazy import lazy_module
from .compat import REFUSED as _REFUSED, TOP_LEVEL_ONLY as _TOP_LEVEL_ONLY

_EXPORTS = {
    # configuration objects
    **{name: ".dataclasses" for name in (
        "DistributedType", "PrecisionType", "RNGType", "DDPCommunicationHookType", "KwargsHandler",
        "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs",
        "GradientAccumulationPlugin", "DataLoaderConfiguration", "ProjectConfiguration", "TorchDynamoPlugin",
        "DynamoBackend",
        "LoggerType", "ProfileKwargs", "ActivationCheckpointingKwargs",
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
    # throughput and MFU (Lightning Fabric's names)
    **{name: ".flops" for name in ("measure_flops", "peak_flops", "get_available_flops", "PEAK_FLOPS")},
    "Throughput": ".throughput",
    "ThroughputMonitor": ".throughput_monitor",
    "FullyShardedDataParallelPlugin": ".fsdp_plugin",
    "DeepSpeedPlugin": ".deepspeed_plugin",
    "ParallelismConfig": ".parallelism_config",
    "MegatronLMPlugin": ".megatron_lm",
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
    **{name: ".launch" for name in ("prepare_deepspeed_cmd_env", "prepare_multi_gpu_env",
                                    "prepare_simple_launcher_cmd_env")},
    "save": "..saving",
    "load_checkpoint_in_model": "..model_loading",
    # big-model inference
    **{name: ".modeling" for name in ("compute_module_sizes", "set_module_tensor_to_device", "find_tied_parameters",
                                      "check_device_map", "named_module_tensors", "retie_parameters",
                                      "calculate_maximum_sizes", "check_tied_parameters_in_config",
                                      "check_tied_parameters_on_same_device", "dtype_byte_size",
                                      "extract_submodules_state_dict", "id_tensor_storage", "load_state_dict",
                                      "get_max_layer_size")},
    **{name: ".device_map" for name in ("get_max_memory", "get_balanced_memory", "infer_auto_device_map",
                                        "convert_file_size_to_int")},
    **{name: ".offload" for name in ("OffloadedWeightsLoader", "PrefixedDataset", "offload_state_dict",
                                     "offload_weight", "save_offload_index", "load_offloaded_weight",
                                     "load_offloaded_weights")},
    **{name: "..hooks" for name in ("align_module_device", "has_offloaded_params")},
    # the rest of accelerate.utils (issue 19); hasten.utils.compat says where each differs
    **{name: ".versions" for name in ("compare_versions", "is_torch_version")},
    **{name: ".constants" for name in (
        "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION", "MODEL_NAME", "OPTIMIZER_NAME", "PROFILE_PATTERN_NAME",
        "RNG_STATE_NAME", "SAFE_MODEL_NAME", "SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_PATTERN_NAME",
        "SAMPLER_NAME", "SCALER_NAME", "SCHEDULER_NAME", "TORCH_DISTRIBUTED_OPERATION_TYPES", "TORCH_LAUNCH_PARAMS",
        "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "WEIGHTS_PATTERN_NAME", "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
    )},
    **{name: ".other" for name in (
        "is_compiled_module", "has_compiled_regions", "compile_regions", "compile_regions_deepspeed",
        "compile_regions_fsdp2", "model_has_dtensor", "get_model_tp_size", "extract_model_from_parallel",
        "wait_for_everyone", "clean_state_dict_for_safetensors", "load", "get_pretty_name", "merge_dicts",
        "is_port_in_use", "convert_bytes", "check_os_kernel", "recursive_getattr", "get_module_children_bottom_up",
        "is_peft_model", "get_grad_scaler", "get_mixed_precision_context_manager",
    )},
    **{name: ".env_compat" for name in (
        "str_to_bool", "get_int_from_env", "parse_flag_from_env", "parse_choice_from_env", "are_libraries_initialized",
        "convert_dict_to_env_variables", "get_current_device_type", "get_gpu_info", "check_cuda_p2p_ib_support",
        "check_cuda_fp8_capability", "get_cpu_distributed_information", "purge_accelerate_environment",
        "purge_hasten_environment",
        "deepspeed_required", "torchao_required", "is_habana_gaudi1",
    )},
    **{name: ".fsdp_utils" for name in (
        "save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer", "merge_fsdp_weights",
        "enable_fsdp_ram_efficient_loading", "disable_fsdp_ram_efficient_loading", "ensure_weights_retied",
    )},
    **{name: ".parallel_configs" for name in (
        "TorchTensorParallelPlugin", "TorchTensorParallelConfig", "TorchContextParallelConfig",
    )},
    **{name: ".tensor_info" for name in (
        "TensorInformation", "get_data_structure", "initialize_tensors", "is_tensor_information", "pad_input_tensors",
    )},
    **{name: ".kinds" for name in ("ComputeEnvironment", "SageMakerDistributedType", "CustomDtype")},
    **{name: ".quantization_compat" for name in (
        "filter_first_and_last_linear_layers", "has_ao_layers", "convert_model_to_fp8_ao",
        "has_transformer_engine_layers", "has_4bit_bnb_layers",
    )},
    **{name: ".deepspeed_compat" for name in ("get_active_deepspeed_plugin", "GatheredParameters", "HfDeepSpeedConfig")},
    # names whose feature hasten lacks: they import, and raise on use (hasten.utils.compat.REFUSED)
    **{name: ".refused" for name in _REFUSED if name not in _TOP_LEVEL_ONLY},
    "FeatureNotAvailableError": ".compat",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_module(__name__, _EXPORTS)
