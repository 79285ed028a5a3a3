"""Accelerate's ``accelerate.utils.bnb`` (bitsandbytes quantisation), which hasten does not have.

The module imports, so scripts and test suites that import from it still load; the quantising
functions raise ``FeatureNotAvailableError`` with the reason and the alternative
(``compat.REFUSED["load_and_quantize_model"]``). ``has_4bit_bnb_layers`` works: it only looks at the
module classes.
"""

from __future__ import annotations

from typing import Any, NoReturn

from .._lazy import lazy_module
from .compat import REFUSED, FeatureNotAvailableError

__getattr__, __dir__ = lazy_module(__name__, {
    "load_and_quantize_model": "hasten.utils.refused",
    "has_4bit_bnb_layers": "hasten.utils.quantization_compat",
})


def _refuse(name: str) -> NoReturn:
    raise FeatureNotAvailableError(f"{name} is not available in hasten: {REFUSED['load_and_quantize_model']}")


def get_quantized_model_device_map(*args: Any, **kwargs: Any) -> NoReturn:
    """Not available in hasten (bitsandbytes quantisation); raises ``FeatureNotAvailableError``."""
    _refuse("get_quantized_model_device_map")


def replace_with_bnb_layers(*args: Any, **kwargs: Any) -> NoReturn:
    """Not available in hasten (bitsandbytes quantisation); raises ``FeatureNotAvailableError``."""
    _refuse("replace_with_bnb_layers")


def quantize_and_offload_8bit(*args: Any, **kwargs: Any) -> NoReturn:
    """Not available in hasten (bitsandbytes quantisation); raises ``FeatureNotAvailableError``."""
    _refuse("quantize_and_offload_8bit")
