"""Accelerate's FSDP save/load/merge helpers, with its signatures and file names, over DCP and safetensors.

``save_fsdp_model`` writes what Accelerate writes: with ``state_dict_type="SHARDED_STATE_DICT"`` a
torch.distributed.checkpoint folder ``pytorch_model_fsdp_{index}`` (each process its shards), else one
full ``pytorch_model_fsdp[_{index}].bin`` from the main process. ``merge_fsdp_weights`` turns such a
folder into ``model.safetensors`` (``hasten merge-weights`` does the same from the command line).
``accelerator.save_state``/``load_state`` remain the way to checkpoint a run; these exist so that
scripts written for Accelerate keep working.
"""

from __future__ import annotations

import os
from typing import Any

_SHARDED = "SHARDED_STATE_DICT"


def _sharded(fsdp_plugin: Any) -> bool:
    from .fsdp_plugin import _state_dict_kind

    return _state_dict_kind(getattr(fsdp_plugin, "state_dict_type", None) or "FULL_STATE_DICT") == _SHARDED


def _refuse_adapter_only(adapter_only: bool, what: str) -> None:
    if adapter_only:
        raise NotImplementedError(f"{what}(adapter_only=True) is not supported by hasten; save the adapter with peft "
                                  "(unwrapped_model.save_pretrained(folder)) or save the whole model")


def _model(accelerator: Any, model: Any) -> Any:
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def _file(kind: str, index: int) -> str:
    return f"{kind}.bin" if index == 0 else f"{kind}_{index}.bin"


def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, output_dir: str, model_index: int = 0,
                    adapter_only: bool = False, use_dcp: bool = True) -> None:
    """Save ``model``'s weights into ``output_dir`` as Accelerate does (see the module docstring). Every
    process must call it. ``use_dcp`` is accepted for Accelerate's signature: sharded saves always use DCP."""
    _refuse_adapter_only(adapter_only, "save_fsdp_model")
    os.makedirs(output_dir, exist_ok=True)
    inner = _model(accelerator, model)
    if _sharded(fsdp_plugin):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        dcp.save({"model": get_model_state_dict(inner)},
                 checkpoint_id=os.path.join(output_dir, f"pytorch_model_fsdp_{model_index}"))
    else:
        from ..saving import save

        state = accelerator.get_state_dict(model)  # the full weights, gathered from the shards
        save(state, os.path.join(output_dir, _file("pytorch_model_fsdp", model_index)))
    accelerator.wait_for_everyone()


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, input_dir: str, model_index: int = 0,
                    adapter_only: bool = False, use_dcp: bool = True) -> None:
    """Load weights that ``save_fsdp_model`` wrote into the (prepared) ``model``, on every process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from ..files import weights_only

    _refuse_adapter_only(adapter_only, "load_fsdp_model")
    inner = _model(accelerator, model)
    if _sharded(fsdp_plugin):
        from ..checkpointing.dcp_reader import load_folder

        folder = input_dir if "pytorch_model_fsdp" in os.path.basename(os.path.normpath(input_dir)) else \
            os.path.join(input_dir, f"pytorch_model_fsdp_{model_index}")
        state = {"model": get_model_state_dict(inner)}
        load_folder(state, folder)  # never DCP's pickle.load of .metadata: it could run code
        set_model_state_dict(inner, state["model"])
    else:
        path = os.path.join(input_dir, _file("pytorch_model_fsdp", model_index))
        full = weights_only.load(path)  # bounded allow-list unpickler
        set_model_state_dict(inner, full, options=StateDictOptions(full_state_dict=True))
    accelerator.wait_for_everyone()


def _torch_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # inside hasten's AcceleratedOptimizer


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any, output_dir: str,
                        optimizer_index: int = 0, use_dcp: bool = True) -> None:
    """Save the optimizer state as Accelerate does: a DCP folder ``optimizer_{index}`` when sharded, else a
    full ``optimizer[_{index}].bin`` from the main process. Every process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    os.makedirs(output_dir, exist_ok=True)
    inner, optim = _model(accelerator, model), _torch_optimizer(optimizer)
    if _sharded(fsdp_plugin):
        import torch.distributed.checkpoint as dcp

        dcp.save({"optimizer": get_optimizer_state_dict(inner, optim)},
                 checkpoint_id=os.path.join(output_dir, f"optimizer_{optimizer_index}"))
    else:
        from ..saving import save

        state = get_optimizer_state_dict(inner, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        save(state, os.path.join(output_dir, _file("optimizer", optimizer_index)))
    accelerator.wait_for_everyone()


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any, input_dir: str,
                        optimizer_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> None:
    """Load optimizer state that ``save_fsdp_optimizer`` wrote, on every process."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    from ..files import weights_only

    _refuse_adapter_only(adapter_only, "load_fsdp_optimizer")
    inner, optim = _model(accelerator, model), _torch_optimizer(optimizer)
    if _sharded(fsdp_plugin):
        from ..checkpointing.dcp_reader import load_folder

        folder = input_dir if "optimizer" in os.path.basename(os.path.normpath(input_dir)) else \
            os.path.join(input_dir, f"optimizer_{optimizer_index}")
        state = {"optimizer": get_optimizer_state_dict(inner, optim)}
        load_folder(state, folder)
        set_optimizer_state_dict(inner, optim, state["optimizer"])
    else:
        path = os.path.join(input_dir, _file("optimizer", optimizer_index))
        full = weights_only.load(path)  # bounded allow-list unpickler
        set_optimizer_state_dict(inner, optim, full, options=StateDictOptions(full_state_dict=True))
    accelerator.wait_for_everyone()


def merge_fsdp_weights(checkpoint_dir: str, output_path: str, safe_serialization: bool = True,
                       remove_checkpoint_dir: bool = False) -> None:
    """Write the full weights of a sharded checkpoint (a DCP folder such as ``pytorch_model_fsdp_0``, a
    DeepSpeed or a hasten checkpoint) to ``output_path`` as ``model.safetensors`` (``pytorch_model.bin``
    when not ``safe_serialization``), in this one process. Weights already there are replaced, as in
    Accelerate. Run it on one process (the main one) only."""
    from ..commands.errors import HastenCLIError
    from ..commands.merge import merge_weights

    try:
        merge_weights(str(checkpoint_dir), str(output_path), safe_serialization, remove_checkpoint_dir, overwrite=True)
    except HastenCLIError as e:
        raise ValueError(f"merge_fsdp_weights: {e}") from None


def enable_fsdp_ram_efficient_loading() -> None:
    """Turn on ``cpu_ram_efficient_loading`` for FSDP plugins created after this call (sets ``FSDP_CPU_RAM_EFFICIENT_LOADING``)."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    """Turn off ``cpu_ram_efficient_loading`` for FSDP plugins created after this call."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"


def ensure_weights_retied(param_init_fn: Any, model: Any, device: Any) -> Any:
    """``param_init_fn`` wrapped so that weights tied in ``model`` stay tied after it re-creates parameters
    of a module (as FSDP's ``param_init_fn`` does for meta-device models)."""
    import torch

    tied: dict[int, list[tuple[Any, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            tied.setdefault(id(param), []).append((module, name))
    groups = [owners for owners in tied.values() if len(owners) > 1]
    if not groups:
        return param_init_fn

    def init_and_retie(module: Any) -> Any:
        result = param_init_fn(module)
        for owners in groups:
            first_module, first_name = owners[0]
            first = getattr(first_module, first_name)
            for owner, name in owners[1:]:
                if getattr(owner, name) is not first and isinstance(first, torch.nn.Parameter):
                    setattr(owner, name, first)
        return result

    return init_and_retie


# Accelerate has these names in this module; hasten keeps them elsewhere (see accelerate_paths).
from .accelerate_paths import names_from_utils  # noqa: E402 - after the module's own names

__getattr__ = names_from_utils(__name__, (
    "fsdp2_load_full_state_dict", "fsdp2_switch_optimizer_parameters", "fsdp2_apply_ac", "fsdp2_prepare_model",
    "get_fsdp2_grad_scaler", "fsdp2_canonicalize_names",
))
