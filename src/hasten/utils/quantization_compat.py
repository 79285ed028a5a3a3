"""Accelerate's torchao fp8 helpers and the layer checks for Transformer Engine and bitsandbytes.

``mixed_precision="fp8"`` in ``Accelerator`` converts models itself (``hasten.fp8``); these are for
scripts that convert by hand. Layer checks go by class, so they import nothing that is not installed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn


def _has_layer(model: nn.Module, module_prefix: str, class_names: tuple[str, ...]) -> bool:
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__module__.startswith(module_prefix) and cls.__name__ in class_names:
                return True
    return False


def filter_first_and_last_linear_layers(module: nn.Module, fqn: str) -> bool:
    """Whether ``module`` (the layer named ``fqn``) should become fp8 under Accelerate's default rule:
    not the first or last Linear of ``module`` and, for a Linear, both sizes multiples of 16."""
    from ..fp8 import default_module_filter

    return default_module_filter(module)(module, fqn)


def has_ao_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds torchao ``Float8Linear`` layers."""
    return _has_layer(model, "torchao", ("Float8Linear",))


def convert_model_to_fp8_ao(model: nn.Module, config: Optional[Any] = None,
                            module_filter_func: Optional[Callable] = None) -> None:
    """Swap ``model``'s Linear layers for torchao ``Float8Linear`` in place; by default all but the first
    and last and those with a size not a multiple of 16 (Accelerate's rule)."""
    from ..fp8 import default_module_filter, import_torchao_float8

    float8 = import_torchao_float8()
    float8.convert_to_float8_training(model, module_filter_fn=module_filter_func or default_module_filter(model),
                                      config=config)


def has_transformer_engine_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds Transformer Engine ``Linear``/``LayerNorm``/``TransformerLayer`` layers."""
    from .imports import is_transformer_engine_available

    if not is_transformer_engine_available():
        raise ImportError("has_transformer_engine_layers needs transformer_engine; install it")
    return _has_layer(model, "transformer_engine", ("Linear", "LayerNorm", "TransformerLayer"))


def has_4bit_bnb_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds bitsandbytes ``Linear4bit`` layers."""
    return _has_layer(model, "bitsandbytes", ("Linear4bit",))
