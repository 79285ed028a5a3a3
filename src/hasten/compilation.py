"""Regional compilation: compile the repeated blocks of a model once instead of the whole graph.

A transformer is mostly N copies of one block class in a ``ModuleList``. Compiling the whole model
traces all N; compiling each block on its own lets the compiler trace the first one and reuse that
work for the others (their code and guards are the same), which cuts the cold-start time roughly by
N. The rest of the model (embeddings, head) is compiled piece by piece.

Modules are compiled in place (``nn.Module.compile``): no ``OptimizedModule`` wrappers appear, so
state-dict keys, ``unwrap_model`` and the hooks that DDP or FSDP add afterwards are unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def is_repeated_blocks(module: nn.Module) -> bool:
    """A ``ModuleList`` whose items are all of one class (the layers of a transformer)."""
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    kind = type(module[0])
    return all(type(block) is kind for block in module)


def has_repeated_blocks(module: nn.Module) -> bool:
    """Whether ``module`` or any module below it holds repeated blocks."""
    return any(is_repeated_blocks(sub) for sub in module.modules())


def compile_regions(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compile ``module`` region by region, in place; returns ``module``.

    Each block of a repeated-blocks ``ModuleList`` is compiled on its own; a module holding such a
    list somewhere below is descended into; any other module is compiled as a whole. A model
    without repeated blocks is therefore compiled whole (in place).
    """
    if is_repeated_blocks(module):
        for block in module:
            block.compile(**compile_kwargs)
    elif has_repeated_blocks(module):
        for child in module.children():
            compile_regions(child, **compile_kwargs)
        # a module's own forward still runs eagerly: it only calls the (compiled) children
    else:
        module.compile(**compile_kwargs)
    return module
