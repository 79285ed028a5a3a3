"""How each public name of Accelerate 1.15 stands in hasten: one place that the placeholders, the
tests and ``tools/compat_table.py`` (which writes docs/compatibility.md) all read.

A name is *present* when hasten has it with Accelerate's signature and behaviour, *different* when it
is there but behaves differently in the way ``DIFFERENT`` says, and *refused* when the feature cannot
exist here: the name still imports (scripts load), and using it raises ``FeatureNotAvailableError``
with the reason and the alternative in ``REFUSED``. Nothing here imports torch.
"""

from __future__ import annotations

_MEGATRON = ("Megatron-LM's engine is not used: MegatronLMPlugin maps onto hasten's own layout; for tensor "
             "parallelism use Accelerator(parallelism_config=ParallelismConfig(tp_size=...)) (DTensor, with FSDP2 "
             "for the rest), for pipelines ParallelismConfig(pp_size=...)")
_BNB = ("bitsandbytes quantisation is not supported (bitsandbytes needs a CUDA or XPU build; it has nothing for "
        "CPU); quantise when loading with transformers (from_pretrained(quantization_config=...)) or with torchao")
_DS_WRAPPER = "an internal of Accelerate's prepare: accelerator.prepare(model, optimizer, scheduler) builds the DeepSpeed engine"
_FSDP2_INTERNAL = ("an internal of Accelerate's FSDP2 preparation: accelerator.prepare(model) does this when the "
                   "Accelerator has a FullyShardedDataParallelPlugin")
_LAUNCH_INTERNAL = "an internal of Accelerate's launcher: launch with `hasten launch` or hasten.notebook_launcher"
_TE_CONVERT = ("Transformer Engine conversion happens in accelerator.prepare: "
               "Accelerator(mixed_precision='fp8', kwargs_handlers=[TERecipeKwargs(...)])")
_XLA = "TPUs (torch_xla) are not supported by hasten; run on CPU or CUDA GPUs"

# name -> why it cannot exist here, and what to use instead. prepare_pippy and rich are top-level names.
TOP_LEVEL_ONLY = frozenset({"prepare_pippy", "rich"})
REFUSED: dict[str, str] = {
    "MegatronLMDummyDataLoader": ("Megatron's dataset pipeline is not used (MegatronLMPlugin maps onto "
                                  "ParallelismConfig); prepare a torch DataLoader with accelerator.prepare"),
    "MegatronLMDummyScheduler": ("Megatron's scheduler is not used (MegatronLMPlugin maps onto ParallelismConfig); "
                                 "pass a torch LR scheduler to accelerator.prepare"),
    **dict.fromkeys(("AbstractTrainStep", "BertTrainStep", "GPTTrainStep", "T5TrainStep"),
                    "Megatron's train step is not used (MegatronLMPlugin maps onto ParallelismConfig); compute the "
                    "loss in your loop and call accelerator.backward(loss)"),
    **dict.fromkeys(("add_model_config_to_megatron_parser",
                     "avg_losses_across_data_parallel_group", "MegatronEngine", "MegatronLMOptimizerWrapper",
                     "MegatronLMSchedulerWrapper", "gather_across_data_parallel_groups", "megatron_lm_initialize",
                     "megatron_lm_prepare_data_loader", "megatron_lm_prepare_model_optimizer_scheduler",
                     "megatron_lm_prepare_optimizer", "megatron_lm_prepare_scheduler"), _MEGATRON),
    **dict.fromkeys(("BnbQuantizationConfig", "load_and_quantize_model"), _BNB),
    **dict.fromkeys(("DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper",
                     "map_pytorch_optim_to_deepspeed"), _DS_WRAPPER),
    "DeepSpeedSequenceParallelConfig": ("Accelerate's sp_handler is not taken: ParallelismConfig(sp_size=N) with a "
                                        "deepspeed_plugin runs DeepSpeed's Ulysses with the model's own attention "
                                        "kernel and any sequence length (docs/sharded.md, Long sequences)"),
    **dict.fromkeys(("fsdp2_apply_ac", "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict", "fsdp2_prepare_model",
                     "fsdp2_switch_optimizer_parameters", "get_fsdp2_grad_scaler"), _FSDP2_INTERNAL),
    "PrepareForLaunch": _LAUNCH_INTERNAL,
    "prepare_sagemager_args_inputs": "launching on Amazon SageMaker is not supported; launch with `hasten launch`",
    **dict.fromkeys(("prepare_tpu", "install_xla"), _XLA),
    **dict.fromkeys(("convert_model", "apply_fp8_autowrap", "contextual_fp8_autocast"), _TE_CONVERT),
    "set_numa_affinity": ("hasten does not pin processes to NUMA nodes; start the launch under "
                          "`numactl --cpunodebind=N --membind=N`"),
    "rich": "hasten does not install rich's traceback handler on import; call rich.traceback.install() yourself",
    "prepare_pippy": ("pipeline-parallel inference (PiPPy) is not supported; for a model larger than one device use "
                      "big-model inference (dispatch_model / device_map='auto'), for more throughput "
                      "PartialState().split_between_processes"),
}

_LAYOUT = ("Accelerate's value; hasten's save_state folder has its own layout (docs/checkpoints.md), so this "
           "only says where Accelerate would put the file")
_SAVE_FSDP = ("adapter_only=True raises (save a peft adapter with save_pretrained); use_dcp is accepted and "
              "ignored: sharded saves always use DCP")

# name -> how hasten's version differs from Accelerate's.
DIFFERENT: dict[str, str] = {
    "MegatronLMPlugin": ("mapped onto ParallelismConfig (tp_degree -> tp_size, pp_degree -> pp_size, num_micro_batches "
                         "-> pp_microbatches, context_parallel_size -> cp_size) and run by hasten's own tensor "
                         "parallelism and pipeline; Megatron's train step is not used, and its engine-only options "
                         "(datasets, custom train step, distributed optimizer, sequence parallelism) raise"),
    "compile_regions": ("compiles in place (nn.Module.compile) and returns the same module; Accelerate returns a "
                        "copy holding torch.compile wrappers. State-dict keys keep no `_orig_mod.`"),
    "has_compiled_regions": "also counts blocks compiled in place, which is how hasten's compile_regions compiles",
    "load": "weights_only=False raises: hasten never unpickles arbitrary objects (Accelerate allows it)",
    "TorchTensorParallelPlugin": "torch_device_mesh raises: hasten builds the device mesh from the launched processes",
    "TorchTensorParallelConfig": "enable_async_tp=True raises (Accelerate warns and ignores it)",
    "merge_fsdp_weights": "also takes DeepSpeed and hasten checkpoint folders (what `hasten merge-weights` reads)",
    "save_fsdp_model": _SAVE_FSDP,
    "load_fsdp_model": _SAVE_FSDP,
    "load_fsdp_optimizer": "adapter_only=True raises; use_dcp is accepted and ignored",
    "check_cuda_fp8_capability": "False on a machine without a CUDA GPU (Accelerate raises)",
    "purge_accelerate_environment": "also puts back the HASTEN_* variables, not only ACCELERATE_*",
    "get_grad_scaler": "torch.amp.GradScaler for the process's device, ShardedGradScaler under FSDP; no XLA scaler",
    "get_mixed_precision_context_manager": "bf16 and fp8 autocast in bf16 under every distributed type",
    "GatheredParameters": "decides by the parameters (ZeRO-3 partitioned or not), not by the AcceleratorState",
    "ensure_weights_retied": "always wraps when the model has tied weights (Accelerate only when ram-efficient loading is on)",
    "write_basic_config": "save_location defaults to hasten's config folder",
    "InitProcessGroupKwargs": "backend=None picks the backend for the device (gloo on CPU, nccl on CUDA)",
    **dict.fromkeys(("OPTIMIZER_NAME", "SCHEDULER_NAME", "SAMPLER_NAME", "SCALER_NAME", "RNG_STATE_NAME"), _LAYOUT),
}

# Big-model inference: implemented by a separate change. The table reports them present once hasten has them.
BIG_MODEL = frozenset({
    "align_module_device", "calculate_maximum_sizes", "check_device_map", "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device", "compute_module_sizes", "convert_file_size_to_int", "dtype_byte_size",
    "find_tied_parameters", "get_balanced_memory", "get_max_layer_size", "get_max_memory", "has_offloaded_params",
    "id_tensor_storage", "infer_auto_device_map", "load_checkpoint_in_model", "load_offloaded_weights",
    "load_state_dict", "named_module_tensors", "retie_parameters", "set_module_tensor_to_device",
    "OffloadedWeightsLoader", "PrefixedDataset", "extract_submodules_state_dict", "load_offloaded_weight",
    "offload_state_dict", "offload_weight", "save_offload_index",
    # top level
    "cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model", "init_empty_weights", "init_on_device",
    "load_checkpoint_and_dispatch", "big_modeling", "hooks",
})


class FeatureNotAvailableError(NotImplementedError):
    """Raised when a script uses an Accelerate name whose feature hasten does not have (see ``REFUSED``)."""


def refusal(name: str) -> FeatureNotAvailableError:
    """The error for using the refused name ``name``."""
    return FeatureNotAvailableError(f"{name} is not available in hasten: {REFUSED[name]}")
