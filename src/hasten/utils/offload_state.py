"""State dicts of models whose weights are offloaded (to CPU RAM or disk) by hasten's hooks.

An offloaded module holds ``meta`` stand-ins; its real weights live in its hook's weights map
(memory or the offload folder). These helpers load them module by module, so that at most one
module's weights are materialised at a time besides the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from ..warning_kinds import HastenWarning

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn


def get_state_dict_offloaded_model(model: "nn.Module") -> dict[str, "torch.Tensor"]:
    """The full state dict of ``model`` on CPU, offloaded weights read back from where they are kept.

    Tensors that are on ``meta`` with no offloaded copy anywhere are left out, with a warning.
    """
    import warnings

    from ..hooks import align_module_device
    from .modeling import non_persistent_buffers

    state: dict[str, Any] = {}
    missing: set[str] = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        skipped = non_persistent_buffers(module)
        with align_module_device(module, "cpu"):
            own = [*module.named_parameters(recurse=False),
                   *((k, v) for k, v in module.named_buffers(recurse=False) if k not in skipped)]
            for key, value in own:
                if value.device.type == "meta":
                    missing.add(prefix + key)
                elif prefix + key not in state:
                    state[prefix + key] = value.detach().to("cpu", copy=True)
    missing -= set(state)
    if missing:
        warnings.warn(f"these tensors are on the meta device with no offloaded copy and were left out: "
                      f"{sorted(missing)}", HastenWarning, stacklevel=2)
    return {key: state[key] for key in model.state_dict() if key in state}


def get_state_dict_from_offload(module: "nn.Module", module_name: str, state_dict: dict[str, Any],
                                device_to_put_offload: Union[int, str, "torch.device"] = "cpu") -> dict[str, Any]:
    """Fill the entries of ``state_dict`` that belong to ``module`` (whose parameter ``module_name``,
    e.g. ``"layer.weight"``, names it) with its real tensors: offloaded ones loaded on
    ``device_to_put_offload``, others as they are. Returns ``state_dict``."""
    from ..hooks import align_module_device, has_offloaded_params

    root = module_name.rpartition(".")[0]
    prefix = f"{root}." if root else ""
    with align_module_device(module, device_to_put_offload if has_offloaded_params(module) else None):
        for key, value in module.state_dict().items():
            if prefix + key in state_dict:
                state_dict[prefix + key] = value.detach().clone()
    return state_dict
