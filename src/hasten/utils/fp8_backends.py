"""Which fp8 backends are installed, and torchao's float8 config built from ``AORecipeKwargs``.

Below both the recipe objects (``fp8_recipes``, which validate themselves when constructed) and the
fp8 training code (``hasten.fp8``). Torch-free at import: torchao is imported when a config is built.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from typing import Any, Iterator, Optional

from .environment import parse_flag

PACKAGES = {  # backend -> (import name, what to tell the user)
    "AO": ("torchao", "torchao: pip install torchao (or pip install 'hasten[fp8]')"),
    "TE": ("transformer_engine", "NVIDIA Transformer Engine: pip install 'transformer_engine[pytorch]' (needs CUDA)"),
    "MSAMP": ("msamp", "MS-AMP: see https://azure.github.io/MS-AMP/docs/getting-started/installation (needs CUDA)"),
}


def backend_installed(backend: str) -> bool:
    return importlib.util.find_spec(PACKAGES[backend][0]) is not None


def require_backend(backend: str, who: str) -> None:
    """Raise one ImportError naming the missing package and how to install it."""
    if not backend_installed(backend):
        raise ImportError(f"{who} needs {PACKAGES[backend][1]}; it is not installed. Install it, or use "
                          "AORecipeKwargs (torchao), or mixed_precision='bf16'")


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """torchao warns, on import, about each CUDA-only kernel library it cannot load and about a
    missing triton; neither matters to float8 training, and CPU users would see them every run."""
    class DropImportNoise(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            text = str(record.msg)
            return not (text.startswith("Failed to load") or "Detected no triton" in text
                        or "is an Enum subclass and is now natively supported" in text)

    quiet = DropImportNoise()
    # Filters on a logger do not apply to records of its children: put it on each one that warns.
    targets = [logging.getLogger(name) for name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")]
    for target in targets:
        target.addFilter(quiet)
    try:
        yield
    finally:
        for target in targets:
            target.removeFilter(quiet)


def import_torchao_float8() -> Any:
    """``torchao.float8``, imported on first use."""
    require_backend("AO", "mixed_precision='fp8' with the torchao backend")
    with quiet_torchao_import():
        import torchao.float8 as float8
    return float8


def build_ao_config(config: Any, pad_inner_dim: Optional[bool], fsdp_all_gather: Optional[bool]) -> Any:
    """A ``Float8LinearConfig`` from ``AORecipeKwargs``' fields (a recipe name is accepted too)."""
    float8 = import_torchao_float8()
    if isinstance(config, str):
        names = [r.value for r in float8.Float8LinearRecipeName]
        if config.lower() not in names:
            raise ValueError(f"AORecipeKwargs(config={config!r}) is not a torchao recipe; use one of {names} "
                             "or a torchao.float8.Float8LinearConfig")
        config = float8.Float8LinearConfig.from_recipe_name(config.lower())
    if config is None:
        pad = parse_flag("FP8_PAD_INNER_DIM", True) if pad_inner_dim is None else pad_inner_dim
        gather = parse_flag("FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", True) if fsdp_all_gather is None else fsdp_all_gather
        return float8.Float8LinearConfig(pad_inner_dim=bool(pad), enable_fsdp_float8_all_gather=bool(gather))
    if not isinstance(config, float8.Float8LinearConfig):
        raise TypeError(f"AORecipeKwargs(config=...) got a {type(config).__name__}; pass a "
                        "torchao.float8.Float8LinearConfig, a recipe name ('tensorwise', 'rowwise') or None")
    # Accelerate ignores these two next to a config; silently dropping a setting is worse.
    if fsdp_all_gather and not config.enable_fsdp_float8_all_gather and recipe_label(config) == "rowwise":
        raise ValueError("AORecipeKwargs(enable_fsdp_float8_all_gather=True) cannot go with a rowwise recipe: torchao "
                         "all-gathers only tensorwise-scaled weights in float8. Use config='tensorwise', or leave "
                         "enable_fsdp_float8_all_gather unset (FSDP2 then all-gathers rowwise weights in bf16)")
    for field_name, value in (("pad_inner_dim", pad_inner_dim), ("enable_fsdp_float8_all_gather", fsdp_all_gather)):
        if value is not None and value != getattr(config, field_name):
            raise ValueError(f"AORecipeKwargs({field_name}={value}) contradicts config.{field_name}="
                             f"{getattr(config, field_name)}; set it in the Float8LinearConfig only")
    return config


def recipe_label(config: Any) -> str:
    """"rowwise" or "tensorwise": how a ``Float8LinearConfig`` scales its weights."""
    granularity = str(getattr(config.cast_config_weight, "scaling_granularity", "")).lower()
    return "rowwise" if "axiswise" in granularity else "tensorwise"
