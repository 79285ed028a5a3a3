"""Layerwise casting: weights stored in a small dtype, cast up for each forward (Accelerate's
``attach_layerwise_casting_hooks``).

Only the layers that do the heavy arithmetic (linear and convolution layers) are cast; norms,
embeddings and anything a pattern or class names keep their dtype, because they are small and
lose most accuracy when stored coarsely.
"""

from __future__ import annotations

import re
from typing import Optional, Union

import torch
from torch import nn

from .hooks import ModelHook, add_hook_to_module

CAST_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear)


class LayerwiseCastingHook(ModelHook):
    """Keeps a module's tensors in ``storage_dtype`` between forwards and in ``compute_dtype`` during one."""

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool = False) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(self, module: nn.Module, *args: object, **kwargs: object) -> tuple[tuple, dict]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: object) -> object:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def attach_layerwise_casting_hooks(module: nn.Module, storage_dtype: torch.dtype, compute_dtype: torch.dtype,
                                   skip_modules_pattern: Optional[Union[str, tuple[str, ...]]] = None,
                                   skip_modules_classes: Optional[tuple[type[nn.Module], ...]] = None,
                                   non_blocking: bool = False) -> None:
    """Store the linear/convolution layers of ``module`` in ``storage_dtype``; each forward runs them in ``compute_dtype``.

    skip_modules_pattern: regular expressions searched in the dotted module names; a match (and
    everything under it) is left alone. skip_modules_classes: module classes left alone.
    """
    patterns = (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else tuple(skip_modules_pattern or ())
    skipped_classes = tuple(skip_modules_classes or ())

    def visit(current: nn.Module, name: str) -> None:
        if (skipped_classes and isinstance(current, skipped_classes)) or any(re.search(p, name) for p in patterns):
            return
        if isinstance(current, CAST_LAYERS):
            add_hook_to_module(current, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking), append=True)
            return
        for child_name, child in current.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(module, "")
