"""Building models without memory for their weights: ``init_empty_weights`` / ``init_on_device``.

A model built under ``init_empty_weights()`` has its parameters on the ``meta`` device (shapes
only); FSDP2 with ``cpu_ram_efficient_loading`` then fills the shards from process 0, so a job
of N processes on one machine holds one copy of the model in host memory, not N.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Union


@contextlib.contextmanager
def init_on_device(device: Union[str, Any], include_buffers: bool = False) -> Iterator[None]:
    """Create the parameters (and with ``include_buffers`` the buffers) of modules built inside on ``device``."""
    import torch
    from torch import nn

    device = torch.device(device)
    if include_buffers:
        with device:
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: Any) -> None:
        original(module, name, param)
        if param is not None:
            kind = type(module._parameters[name])
            extra = dict(module._parameters[name].__dict__)
            extra["requires_grad"] = param.requires_grad
            module._parameters[name] = kind(module._parameters[name].to(device), **extra)

    nn.Module.register_parameter = register_parameter  # buffers stay where they are created
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Build models whose parameters take no memory (``meta`` device), e.g. on every process but 0."""
    with init_on_device("meta", include_buffers=include_buffers):
        yield
