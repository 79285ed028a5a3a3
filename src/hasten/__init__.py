"""hasten: run a plain PyTorch training loop on any device and any number of processes."""

from typing import TYPE_CHECKING

from ._lazy import lazy_module

__version__ = "0.1.0"

_EXPORTS = {
    "Accelerator": ".accelerator",
    "PartialState": ".state",
    "AcceleratorState": ".state",
    "GradientState": ".state",
    "DistributedType": ".utils.dataclasses",
    "find_executable_batch_size": ".utils.memory",
    "skip_first_batches": ".data_loader",
    "notebook_launcher": ".launchers",
    "debug_launcher": ".launchers",
    "DataLoaderConfiguration": ".utils.dataclasses",
    "GradientAccumulationPlugin": ".utils.dataclasses",
    "DistributedDataParallelKwargs": ".utils.dataclasses",
    "GradScalerKwargs": ".utils.dataclasses",
    "InitProcessGroupKwargs": ".utils.dataclasses",
    "AutocastKwargs": ".utils.dataclasses",
    "ProjectConfiguration": ".utils.dataclasses",
    "AORecipeKwargs": ".utils.fp8_recipes",
    "TERecipeKwargs": ".utils.fp8_recipes",
    "MSAMPRecipeKwargs": ".utils.fp8_recipes",
    "FP8RecipeKwargs": ".utils.fp8_recipes",
    "DDPCommunicationHookType": ".utils.dataclasses",
    "load_checkpoint_in_model": ".model_loading",
    "synchronize_rng_states": ".utils.random",
    "is_rich_available": ".utils.imports",
    "ProfileKwargs": ".utils.dataclasses",
    "ActivationCheckpointingKwargs": ".utils.dataclasses",
    "LoggerType": ".utils.dataclasses",

    "FullyShardedDataParallelPlugin": ".utils.fsdp_plugin",
    "ParallelismConfig": ".utils.parallelism_config",

    "DeepSpeedPlugin": ".utils.deepspeed_plugin",
    **{name: ".big_modeling" for name in (
        "init_empty_weights", "init_on_device", "cpu_offload", "cpu_offload_with_hook", "disk_offload",
        "dispatch_model", "load_checkpoint_and_dispatch",
    )},
    "infer_auto_device_map": ".utils.device_map",
    "prepare_pippy": ".inference",  # refused: raises on use (hasten.utils.compat.REFUSED)
    "rich": ".utils.refused",  # refused likewise
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_module(__name__, _EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .accelerator import Accelerator
    from .state import AcceleratorState, GradientState, PartialState
    from .utils.dataclasses import DistributedType
