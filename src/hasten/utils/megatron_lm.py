"""``MegatronLMPlugin`` (Accelerate's names), mapped onto hasten's own layout (``ParallelismConfig``).

hasten has no Megatron-LM engine: the plugin's layout (``tp_degree``, ``pp_degree``, ``num_micro_batches``) is
run by hasten's tensor parallelism (DTensor) and pipeline (torch.distributed.pipelining), and the script's
own loop is the train step. What only Megatron's engine can do (its datasets, a custom train step, its
model provider, its distributed optimizer, tensor-parallel sequence parallelism) is refused in one line
naming the native option, not ignored. Torch-free.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

_PREFIX = "MEGATRON_LM_"
# Plugin field -> why it cannot be honoured, and the native option (refused when set to a non-default value).
_REFUSED = {
    "sequence_parallelism": "tensor-parallel sequence parallelism is not in hasten; use "
                            "ParallelismConfig(cp_size=...) (context parallelism) or sequence_parallelism=False",
    "megatron_dataset_flag": "Megatron's indexed datasets are not used; prepare a torch DataLoader with "
                             "accelerator.prepare(dataloader)",
    "custom_train_step_class": "Megatron's train step is not used; compute the loss in your loop and call "
                               "accelerator.backward(loss)",
    "custom_train_step_kwargs": "Megatron's train step is not used; compute the loss in your loop and call "
                                "accelerator.backward(loss)",
    "custom_model_provider_function": "Megatron's model provider is not used; build the model yourself and pass it "
                                      "to accelerator.prepare",
    "custom_prepare_model_function": "Megatron's model preparation is not used; pass the model to accelerator.prepare",
    "custom_megatron_datasets_provider_function": "Megatron's datasets are not used; prepare a torch DataLoader",
    "custom_get_batch_function": "Megatron's batch function is not used; iterate a prepared torch DataLoader",
    "custom_loss_function": "Megatron's loss function is not used; compute the loss in your loop",
    "use_distributed_optimizer": "Megatron's distributed optimizer is not used; shard optimizer state with FSDP2 "
                                 "(ParallelismConfig(dp_shard_size=...) with fsdp_plugin)",
    "recompute_activations": "Megatron's activation recomputation is not used; use "
                             "kwargs_handlers=[ActivationCheckpointingKwargs(...)] or fsdp_activation_checkpointing",
    "num_layers_per_virtual_pipeline_stage": "Megatron's virtual pipeline is not used; use "
                                             "ParallelismConfig(pp_schedule='Interleaved1F1B', pp_stages_per_rank=2)",
    "pipeline_model_parallel_split_rank": "Megatron's encoder/decoder split is not used; name the stage boundaries "
                                          "with ParallelismConfig(pp_split_points=[...])",
    "use_custom_fsdp": "Megatron's FSDP is not used; shard with fsdp_plugin=FullyShardedDataParallelPlugin() "
                       "(FSDP2) and ParallelismConfig(dp_shard_size=...)",
    "optimizer_cpu_offload": "Megatron's optimizer offload is not used; offload with "
                             "FullyShardedDataParallelPlugin(cpu_offload=True) or DeepSpeed",
    "overlap_cpu_optimizer_d2h_h2d": "Megatron's optimizer offload is not used; offload with "
                                     "FullyShardedDataParallelPlugin(cpu_offload=True) or DeepSpeed",
    "recompute_granularity": "Megatron's activation recomputation is not used; use "
                             "kwargs_handlers=[ActivationCheckpointingKwargs(...)] or fsdp_activation_checkpointing",
    "recompute_method": "Megatron's activation recomputation is not used; use "
                        "kwargs_handlers=[ActivationCheckpointingKwargs(...)] or fsdp_activation_checkpointing",
    "recompute_num_layers": "Megatron's activation recomputation is not used; use "
                            "kwargs_handlers=[ActivationCheckpointingKwargs(...)] or fsdp_activation_checkpointing",
    "expert_model_parallel_size": "expert parallelism is not available in hasten (the layout reserves ep at 1); "
                                  "drop it, or set it to 1",
    "expert_tensor_parallel_size": "expert parallelism is not available in hasten (the layout reserves ep at 1); "
                                   "drop it, or set it to 1",
    "decoder_last_pipeline_num_layers": "Megatron's uneven last stage is not used; name the stage boundaries with "
                                        "ParallelismConfig(pp_split_points=[...])",
    "other_megatron_args": "Megatron's own arguments are not used; set the layout with ParallelismConfig",
}
LAUNCHER_WARNED = "HASTEN_MEGATRON_MAPPED"  # set by hasten launch for its processes once it has warned
_MAPPED = ("tp_degree", "pp_degree", "num_micro_batches", "context_parallel_size")
_warned = False


@dataclass
class MegatronLMPlugin:
    """Accelerate's Megatron-LM plugin. hasten reads its layout (``tp_degree``, ``pp_degree``,
    ``num_micro_batches``) into a ``ParallelismConfig``; its training-loop settings (learning-rate schedule,
    iterations, evaluation, logging) belong to Megatron's own train step, which hasten does not run.
    Unset layout fields come from ``MEGATRON_LM_*`` variables, as in Accelerate."""

    tp_degree: Optional[int] = None
    pp_degree: Optional[int] = None
    use_custom_fsdp: Optional[bool] = None
    overlap_cpu_optimizer_d2h_h2d: Optional[bool] = None
    no_load_optim: Optional[bool] = None
    eod_mask_loss: Optional[bool] = None
    no_save_optim: Optional[bool] = None
    optimizer_cpu_offload: Optional[bool] = None
    use_precision_aware_optimizer: Optional[bool] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    attention_backend: Optional[bool] = None
    expert_model_parallel_size: Optional[int] = None
    context_parallel_size: Optional[int] = None
    attention_dropout: Optional[float] = None
    hidden_dropout: Optional[float] = None
    attention_softmax_in_fp32: Optional[bool] = None
    expert_tensor_parallel_size: Optional[int] = None
    calculate_per_token_loss: Optional[bool] = None
    use_rotary_position_embeddings: Optional[bool] = None
    num_micro_batches: Optional[int] = None
    gradient_clipping: Optional[float] = None
    sequence_parallelism: Optional[bool] = None
    recompute_activations: Optional[bool] = None
    use_distributed_optimizer: Optional[bool] = None
    pipeline_model_parallel_split_rank: Optional[int] = None
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    is_train_batch_min: bool = True
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    weight_decay_incr_style: str = "constant"
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    lr_decay_style: str = "linear"
    lr_decay_iters: Optional[int] = None
    lr_decay_samples: Optional[int] = None
    lr_warmup_iters: Optional[int] = None
    lr_warmup_samples: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    min_lr: float = 0
    consumed_samples: Optional[list[int]] = None
    no_wd_decay_cond: Optional[Callable] = None
    scale_lr_cond: Optional[Callable] = None
    lr_mult: float = 1.0
    megatron_dataset_flag: bool = False
    seq_length: Optional[int] = None
    encoder_seq_length: Optional[int] = None
    decoder_seq_length: Optional[int] = None
    tensorboard_dir: Optional[str] = None
    set_all_logging_options: bool = False
    eval_iters: int = 100
    eval_interval: int = 1000
    return_logits: bool = False
    custom_train_step_class: Optional[Any] = None
    custom_train_step_kwargs: Optional[dict[str, Any]] = None
    custom_model_provider_function: Optional[Callable] = None
    custom_prepare_model_function: Optional[Callable] = None
    custom_megatron_datasets_provider_function: Optional[Callable] = None
    custom_get_batch_function: Optional[Callable] = None
    custom_loss_function: Optional[Callable] = None
    other_megatron_args: Optional[dict[str, Any]] = field(default=None)

    def __post_init__(self) -> None:
        env = os.environ.get
        if self.tp_degree is None:
            self.tp_degree = int(env(_PREFIX + "TP_DEGREE", 1))
        if self.pp_degree is None:
            self.pp_degree = int(env(_PREFIX + "PP_DEGREE", 1))
        if self.num_micro_batches is None:
            self.num_micro_batches = int(env(_PREFIX + "NUM_MICRO_BATCHES", 1))
        if self.gradient_clipping is None:
            self.gradient_clipping = float(env(_PREFIX + "GRADIENT_CLIPPING", 1.0))
        for flag in ("recompute_activations", "use_distributed_optimizer", "sequence_parallelism"):
            if getattr(self, flag) is None:
                setattr(self, flag, _env_flag(_PREFIX + flag.upper()))


def _env_flag(name: str) -> bool:
    raw = os.environ.get(name, "false").strip().lower()
    if raw in ("1", "true", "yes", "y", "on"):
        return True
    if raw in ("0", "false", "no", "n", "off", ""):
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a boolean; set it to 1/true/yes or 0/false/no")


def _set(plugin: MegatronLMPlugin, name: str) -> bool:
    value = getattr(plugin, name)
    default = next(f.default for f in fields(MegatronLMPlugin) if f.name == name)
    if name.startswith("expert_"):
        return value not in (None, 1)
    if name == "gradient_clipping":  # 1.0 is what __post_init__ fills in (Accelerate's default)
        return value not in (None, 1.0)
    return value not in (None, False, {}, []) and value != default


def parallelism_from_megatron(plugin: Any, parallelism_config: Any = None) -> Any:
    """The ``ParallelismConfig`` an ``Accelerator`` given ``megatron_lm_plugin`` runs with, or
    ``parallelism_config`` unchanged when no plugin is given. Raises (one line, naming the native
    option) for what only Megatron's engine does; warns once that the native layout is used."""
    if plugin is None:
        return parallelism_config
    if not isinstance(plugin, MegatronLMPlugin):
        raise TypeError(f"megatron_lm_plugin must be a hasten.utils.MegatronLMPlugin, got {type(plugin).__name__}")
    if parallelism_config is not None:
        raise ValueError("pass megatron_lm_plugin or parallelism_config, not both (hasten maps the plugin onto a "
                         "ParallelismConfig: set tp_size, pp_size and pp_microbatches there and drop the plugin)")
    for name, why in _REFUSED.items():
        if _set(plugin, name):
            raise ValueError(f"MegatronLMPlugin({name}={getattr(plugin, name)!r}): {why}")
    if plugin.pp_degree == 1 and plugin.num_micro_batches > 1:
        raise ValueError(f"MegatronLMPlugin(num_micro_batches={plugin.num_micro_batches}) without a pipeline "
                         "(pp_degree=1) is gradient accumulation; use Accelerator(gradient_accumulation_steps="
                         f"{plugin.num_micro_batches}) and num_micro_batches=1")
    from .parallelism_config import ParallelismConfig

    config = ParallelismConfig(tp_size=plugin.tp_degree, pp_size=plugin.pp_degree,
                               cp_size=plugin.context_parallel_size or 1,
                               pp_microbatches=plugin.num_micro_batches if plugin.pp_degree > 1 else None)
    global _warned
    # Under `hasten launch --use_megatron_lm` the launcher printed this warning once for the job.
    if not _warned and not os.environ.get(LAUNCHER_WARNED):
        _warned = True
        unused = [f.name for f in fields(MegatronLMPlugin) if f.name not in _REFUSED
                  and f.name not in _MAPPED and _set(plugin, f.name)]
        warnings.warn(mapping_message(config.tp_size, config.pp_size, config.cp_size, config.pp_microbatches,
                                      config.pp_schedule, unused), UserWarning, stacklevel=4)
    return config


def mapping_message(tp_size: int, pp_size: int, cp_size: int, microbatches: Any, schedule: Any,
                    unused: list[str], dp_replicate_size: int = 1) -> str:
    """The one warning of a Megatron-LM layout run natively (the Accelerator's and ``hasten launch``'s)."""
    return (f"MegatronLMPlugin mapped to ParallelismConfig("
            + (f"dp_replicate_size={dp_replicate_size}, " if dp_replicate_size > 1 else "") +
            f"tp_size={tp_size}, pp_size={pp_size}, "
            + (f"cp_size={cp_size}, " if cp_size > 1 else "") +
            f"pp_microbatches={microbatches}, pp_schedule={schedule!r}); Megatron's own train "
            "step is not used" + (f" (not applied: {', '.join(unused)})" if unused else ""))


def refusal(name: str) -> Optional[str]:
    """Why the plugin field ``name`` cannot be honoured, naming the native option (None: it can)."""
    return _REFUSED.get(name)
