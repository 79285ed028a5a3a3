"""Checks ``Accelerator.prepare_model`` makes before it touches a model (kept out of the facade)."""

from __future__ import annotations

from typing import Any, Callable


def refuse_offloaded_quantized_model(model: Any, cpu_training_possible: Callable[[], bool]) -> None:
    """Refuse a model loaded in 8-bit or 4-bit (bitsandbytes, ``is_loaded_in_8bit``/``_4bit``) whose
    ``hf_device_map`` offloads modules to disk, or to the CPU where bitsandbytes cannot train there
    (``cpu_training_possible()``: its multi-backend build, and no XPU). Such weights cannot be
    trained; Accelerate refuses them the same way."""
    if not (getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)):
        return
    places = {str(place) for place in (getattr(model, "hf_device_map", None) or {}).values()}
    if "disk" in places or ("cpu" in places and not cpu_training_possible()):
        where = ", ".join(sorted(places & {"cpu", "disk"}))
        raise ValueError(
            f"prepare() got a model loaded in 8-bit or 4-bit precision with CPU or disk offload (its hf_device_map "
            f"puts modules on {where}), and such weights cannot be trained; load it whole on the training device "
            "(from_pretrained(..., device_map={'': accelerator.device})), or load it unquantised"
        )
