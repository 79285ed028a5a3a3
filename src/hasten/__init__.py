"""hasten: run a plain PyTorch training loop on any device and any number of processes."""

from typing import TYPE_CHECKING

from ._lazy import lazy_module

# The version scheme (docs/migration.md, "Version numbers"). Scripts written for Accelerate gate features on
# its version (``version.parse(accelerate.__version__) >= version.parse("0.16.0")``); after the word
# replacement they read ``hasten.__version__``. So the package version is the Accelerate release whose API
# hasten implements, with hasten's own release as the post-release number (major*10000 + minor*100 +
# patch): 1.15.0.post100 is hasten 0.1.0 on Accelerate 1.15.0's API. It sorts >= 1.15.0 and < 1.15.1, so
# every such gate takes Accelerate 1.15's branch, it is a plain PEP 440 version (no local label: an index
# accepts it) and it grows with each hasten release. pyproject.toml's ``version`` is this same string, so
# ``importlib.metadata.version("hasten") == hasten.__version__`` (tests/test_version.py checks all three).
__hasten_version__ = "0.1.0"  # hasten's own release number
__accelerate_version__ = "1.15.0"  # the Accelerate release whose API hasten implements
__version__ = "1.15.0.post100"

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
    "install_as_accelerate": ".as_accelerate",  # hasten's own: libraries built on Accelerate, unedited
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_module(__name__, _EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .accelerator import Accelerator
    from .state import AcceleratorState, GradientState, PartialState
    from .utils.dataclasses import DistributedType
