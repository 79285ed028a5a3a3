"""fp8 training: choosing the backend, checking the hardware, converting a model's layers.

``Accelerator(mixed_precision="fp8")`` builds one ``Float8Plan`` from the recipe handler it was
given (``AORecipeKwargs``, ``TERecipeKwargs``, ``MSAMPRecipeKwargs`` or the deprecated
``FP8RecipeKwargs``), or from ``HASTEN_FP8_BACKEND``, or from the first backend installed. The plan
refuses hardware that cannot do fp8 (never a quiet fallback to bf16) and converts each prepared
model before the strategy wraps it. Around the converted layers the model runs under bf16 autocast
(``Precision`` treats "fp8" as bf16), as Accelerate does: torchao's float8 matmuls then return bf16.
Under FSDP2 the bf16 comes from the sharding policy instead, and the converted weights are
all-gathered in float8 (``enable_fsdp_float8_all_gather``) with scales precomputed after each step
(the FSDP2 strategy calls the helpers at the end of this module).

Only torchao is driven here. Transformer Engine and MS-AMP cannot be installed without CUDA;
missing, they fail with the install command; present, with a clear "not driven yet" error.
torchao is imported only when fp8 is used.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from .logging import get_logger
from .utils.fp8_recipes import (
    AORecipeKwargs,
    FP8BackendType,
    FP8RecipeKwargs,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
)
from .utils.environment import env_names, get_env, parse_flag
from .utils.fp8_backends import (
    PACKAGES,
    backend_installed,
    import_torchao_float8,
    quiet_torchao_import,
    recipe_label,
    require_backend,
)
from .warning_kinds import HastenWarning

logger = get_logger(__name__)

RECIPE_CLASSES = (AORecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs)
# torch._scaled_mm with float8 inputs needs Ada (8.9) or Hopper (9.0) tensor cores and newer.
MIN_CUDA_CAPABILITY = (8, 9)


# -- choosing the recipe ---------------------------------------------------------------------------
def select_recipe(handlers: dict[type, Any], mixed_precision: str) -> Optional[Any]:
    """The fp8 recipe handler to use (None without fp8); validates the combination."""
    recipes = [h for h in handlers.values() if isinstance(h, RECIPE_CLASSES)]
    if len(recipes) > 1:
        names = ", ".join(type(r).__name__ for r in recipes)
        raise ValueError(f"kwargs_handlers holds several fp8 recipes ({names}); pass only the one for your backend")
    recipe = recipes[0] if recipes else None
    if mixed_precision != "fp8":
        if recipe is not None:
            raise ValueError(f"{type(recipe).__name__} was passed in kwargs_handlers but mixed_precision="
                             f"{mixed_precision!r}; set mixed_precision='fp8' (or drop the recipe)")
        return None
    if isinstance(recipe, FP8RecipeKwargs):
        return recipe.to_recipe()
    if recipe is not None:
        return recipe
    backend = get_env("FP8_BACKEND")
    if backend:
        backend = backend.strip().upper()
        if backend not in PACKAGES:
            raise ValueError(f"{env_names('FP8_BACKEND')[0]}={backend.lower()!r} is not an fp8 backend; "
                             "use ao (torchao), te (Transformer Engine) or msamp (MS-AMP)")
    else:
        backend = next((b for b in PACKAGES if backend_installed(b)), None)
        if backend is None:
            raise ImportError("mixed_precision='fp8' needs an fp8 backend and none is installed; install "
                              f"{PACKAGES['AO'][1]}, or use mixed_precision='bf16'")
        logger.info(f"fp8: using {PACKAGES[backend][0]}, the first fp8 backend found installed")
    return {"AO": AORecipeKwargs, "TE": TERecipeKwargs, "MSAMP": MSAMPRecipeKwargs}[backend]()


def backend_of(recipe: Any) -> FP8BackendType:
    if isinstance(recipe, AORecipeKwargs):
        return FP8BackendType.AO
    return FP8BackendType.TE if isinstance(recipe, TERecipeKwargs) else FP8BackendType.MSAMP


# -- the hardware ----------------------------------------------------------------------------------
def check_fp8_device(backend: FP8BackendType, device: torch.device) -> None:
    """Raise if ``device`` cannot run fp8 with ``backend``.

    "Can run" means: on CUDA, compute capability 8.9 or newer; on any device, a float8
    ``torch._scaled_mm`` actually runs there (CPU builds of torch 2.13 have one; MPS does not).
    """
    if backend != FP8BackendType.AO and device.type != "cuda":
        raise ValueError(f"mixed_precision='fp8' with {PACKAGES[backend.value][0]} needs a CUDA GPU; "
                         f"this process runs on {device.type}. Use the torchao backend (AORecipeKwargs) "
                         "or mixed_precision='bf16'")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CUDA_CAPABILITY:
            raise ValueError(
                f"mixed_precision='fp8' needs a GPU with compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}. Use mixed_precision='bf16'"
            )
    if backend == FP8BackendType.AO:
        _probe_scaled_mm(device)


def _probe_scaled_mm(device: torch.device) -> None:
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"mixed_precision='fp8' cannot run on {device}: a float8 matrix multiply "
                         f"(torch._scaled_mm) fails there ({reason}). Use mixed_precision='bf16'") from None


# -- converting a model ----------------------------------------------------------------------------
def first_and_last_linear(model: nn.Module) -> tuple[Optional[str], Optional[str]]:
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def default_module_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """Accelerate's rule: convert every Linear except the first, the last, and any whose in or out
    dimension is not a multiple of 16 (the first and last layers are the most sensitive to fp8)."""
    keep = set(first_and_last_linear(model))

    def convert(module: nn.Module, fqn: str) -> bool:
        if isinstance(module, nn.Linear) and (module.in_features % 16 or module.out_features % 16):
            return False
        return fqn not in keep

    return convert


class Float8Plan:
    """What ``mixed_precision="fp8"`` does to each prepared model.

    Args:
        recipe: the fp8 recipe handler (see ``select_recipe``).
        device: the device the processes train on (checked here).
        sharded: whether a sharding strategy (FSDP2) will wrap the models; float8 all-gather
            only means something then.
    """

    def __init__(self, recipe: Any, device: torch.device, sharded: bool = False) -> None:
        self.recipe = recipe
        self.backend = backend_of(recipe)
        require_backend(self.backend.value, f"mixed_precision='fp8' with {type(recipe).__name__}")
        check_fp8_device(self.backend, device)
        if self.backend != FP8BackendType.AO:
            raise NotImplementedError(
                f"hasten drives fp8 through torchao only for now; {PACKAGES[self.backend.value][0]} is installed "
                "but not supported yet. Use AORecipeKwargs (torchao) instead"
            )
        self.config = recipe.config
        self.device = device
        self._warned: set[str] = set()  # each speed warning once per Accelerator, however many models
        auto = getattr(recipe, "auto_compile", None)
        self.auto_compile = parse_flag("FP8_AUTO_COMPILE", device.type == "cuda") if auto is None else auto
        if not sharded and self.config.enable_fsdp_float8_all_gather:
            # The all-gather wrapper replaces each weight Parameter, so an optimizer built before
            # prepare() would keep updating the old ones (Accelerate 1.15 trains nothing in the
            # converted layers this way). Without FSDP the wrapper does nothing else: leave it out.
            # Under FSDP2 the strategy re-points optimizers at the sharded wrappers (convert_fp8).
            import dataclasses

            self.config = dataclasses.replace(self.config, enable_fsdp_float8_all_gather=False)

    @property
    def float8_all_gather(self) -> bool:
        """Whether converted weights are all-gathered by FSDP2 in float8 (and their scales precomputed)."""
        return bool(self.config.enable_fsdp_float8_all_gather)

    def convert(self, model: nn.Module) -> list[str]:
        """Swap the chosen ``nn.Linear`` layers of ``model`` for float8 ones, in place; returns their names.

        A model that already holds float8 layers (converted by the user) is left as it is. The
        weight ``Parameter`` objects stay the same, except with float8 all-gather (FSDP2), where
        torchao wraps each converted weight in a new one (the strategy maps the old to the new).
        """
        float8 = import_torchao_float8()
        from torchao.float8.float8_linear import Float8Linear

        already = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
        if already:
            logger.info(f"fp8: the model already has {len(already)} float8 layer(s); not converting it again")
            return already
        linear = [n for n, m in model.named_modules() if type(m) is nn.Linear]
        chosen = self.recipe.module_filter_func or default_module_filter(model)
        params_before = {id(p) for p in model.parameters()}
        float8.convert_to_float8_training(model, config=self.config, module_filter_fn=chosen)
        if not self.float8_all_gather and {id(p) for p in model.parameters()} != params_before:
            raise RuntimeError("converting to float8 replaced the model's parameters, so an optimizer built "
                               "before prepare() would not train them; report this as a hasten bug")
        converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
        kept = [n for n in linear if n not in converted]
        recipe_name = recipe_label(self.config)
        logger.info(f"fp8 (torchao, {recipe_name}): {len(converted)} of {len(linear)} Linear layer(s) converted "
                    f"to float8: {', '.join(converted) or 'none'}; kept in high precision: {', '.join(kept) or 'none'}")
        if not converted:
            logger.warning("fp8: no layer was converted to float8 (the filter kept every Linear in high "
                           "precision), so this model trains in bf16")
        return converted


    def speed_up(self, model: nn.Module, compiled: bool) -> list[str]:
        """Make the converted ``model`` fast, or say once why it will not be; returns the layers compiled here.

        Float8 pays only compiled: eagerly, each layer's scaling and casting runs as a string of small
        kernels and a step is slower than bf16 (about 2x on an H100). So unless the model is
        compiled already (``compiled``: a ``dynamo_backend``/``dynamo_plugin``), each float8 layer
        is compiled in place (``auto_compile``, on by default on CUDA); the model, its keys and its
        wrappers are unchanged. Where fp8 cannot beat bf16 (eager by choice, a CPU, layers below
        the sizes where float8 matmuls win) a warning says so once, with the fix.
        """
        from torchao.float8.float8_linear import Float8Linear

        layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Float8Linear)]
        if not layers:
            return []
        if self.device.type != "cuda":
            self._warn_once(f"mixed_precision='fp8' on {self.device.type}: no float8 matrix units there, so torch emulates "
                      "the float8 matmuls and a step is several times slower than with bf16. Use it to check fp8 "
                      "numerics; train with mixed_precision='bf16' (or on a GPU with compute capability 8.9+)")
        small = [name for name, m in layers if too_small_for_float8(m, recipe_label(self.config))]
        if small and self.device.type == "cuda":
            self._warn_once(f"fp8: {len(small)} of {len(layers)} float8 layer(s) are below the sizes where a float8 matmul "
                      f"beats bf16 on an H100 (torchao's tables), e.g. {small[0]}; they likely run slower than in "
                      "bf16. Keep them in bf16 with AORecipeKwargs(module_filter_func=...), or use mixed_precision='bf16'")
        if compiled:
            return []
        if not self.auto_compile:
            if self.device.type == "cuda":
                self._warn_once("fp8 without torch.compile (AORecipeKwargs(auto_compile=False) or HASTEN_FP8_AUTO_COMPILE=false) "
                          "is slower than bf16: each float8 layer's casts run as separate kernels. Leave auto_compile on, "
                          "or compile the model (Accelerator(dynamo_backend='inductor'))")
            return []
        for _, layer in layers:
            layer.compile()  # in place: no wrapper, same keys; traced on the first call
        names = [name for name, _ in layers]
        logger.info(f"fp8: {len(names)} float8 layer(s) compiled with torch.compile (inductor) so that float8 pays; "
                    "opt out with AORecipeKwargs(auto_compile=False) or HASTEN_FP8_AUTO_COMPILE=false")
        return names


    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, HastenWarning, stacklevel=5)  # the script line that called prepare()


def too_small_for_float8(layer: nn.Module, recipe: str) -> bool:
    """Whether a float8 matmul of this layer's size is slower than bf16 on an H100, by the thresholds of
    torchao's published benchmarks (tensorwise: in <= 4096 and out <= 1024; rowwise: out <= 2048,
    in <= 1024, or both out <= 4096 and in <= 2048)."""
    out_features, in_features = layer.weight.shape
    if recipe == "rowwise":
        return out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048)
    return in_features <= 4096 and out_features <= 1024


def plan_for(handlers: dict[type, Any], mixed_precision: str, device: torch.device,
             sharded: bool = False) -> Optional[Float8Plan]:
    """The fp8 plan for an Accelerator's settings, or None when fp8 is not used."""
    recipe = select_recipe(handlers, mixed_precision)
    return None if recipe is None else Float8Plan(recipe, device, sharded=sharded)


# -- float8 all-gather under FSDP2 -----------------------------------------------------------------
_CAST_WEIGHT = "WeightWithDynamicFloat8CastTensor"  # torchao's weight wrapper that FSDP2 all-gathers in float8


def is_float8_cast_weight(tensor: Any) -> bool:
    """Whether ``tensor`` (or a DTensor's local shard) is torchao's float8 all-gather weight wrapper."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == _CAST_WEIGHT


def gathers_in_float8(model: nn.Module) -> bool:
    """Whether FSDP2 all-gathers some of ``model``'s weights in float8."""
    return any(is_float8_cast_weight(p) for p in model.parameters())


def precompute_float8_scales(model: nn.Module) -> None:
    """Compute the float8 scales of every float8 all-gathered weight of ``model`` from its current
    values, in one all-reduce. Run after each real optimizer step and after loading weights: the
    next all-gather uses them (a stale scale would clip or waste float8's range). Every process
    must call it (collective)."""
    with quiet_torchao_import():
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
