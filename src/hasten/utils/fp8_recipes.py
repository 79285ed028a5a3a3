"""The fp8 recipe objects (``kwargs_handlers``) of the three fp8 backends: torchao, Transformer
Engine and MS-AMP, with Accelerate's fields and defaults (each default can come from
``HASTEN_FP8_<FIELD>``). Torch-free at import; ``fp8_backends`` checks, when a recipe is
constructed, that its backend is installed; ``hasten.fp8`` does the work.

Also importable from ``hasten.utils`` and ``hasten.utils.dataclasses``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from .fp8_backends import backend_installed, build_ao_config, require_backend
from .kwargs_handler import KwargsHandler


class FP8BackendType(str, enum.Enum):
    """The library that runs fp8 training: torchao (AO), Transformer Engine (TE) or MS-AMP."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


def _fp8_choice(owner: str, name: str, value: Optional[str], env: str, default: str, choices: tuple[str, ...],
                upper: bool = True) -> str:
    from .environment import get_env

    if value is None:
        value = get_env(env) or default
    text = str(value).strip()
    text = text.upper() if upper else text.lower()
    if text not in choices:
        raise ValueError(f"{owner}({name}={value!r}) is not valid; use one of {', '.join(choices)}")
    return text


def _fp8_int(owner: str, name: str, value: Optional[int], env: str, default: int, minimum: int) -> int:
    from .environment import parse_int

    if value is None:
        value = parse_int(env, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}({name}={value!r}) is not valid; use a whole number >= {minimum}")
    return value


@dataclass
class AORecipeKwargs(KwargsHandler):
    """fp8 training with torchao (``torchao.float8.convert_to_float8_training``).

    Args:
        config: a ``torchao.float8.Float8LinearConfig``, or a recipe name ("tensorwise", "rowwise",
            "rowwise_with_gw_hp"); None builds one from the two flags below.
        module_filter_func: ``fn(module, fqn) -> bool``, True to convert that layer. Default: every
            ``nn.Linear`` except the first, the last, and those with a dimension not a multiple of 16.
        pad_inner_dim: pad matmul dimensions to multiples of 16 (default True; ``HASTEN_FP8_PAD_INNER_DIM``).
        enable_fsdp_float8_all_gather: all-gather FSDP2 shards in float8 (default True;
            ``HASTEN_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER``); ignored without FSDP2.
        auto_compile: (hasten only) ``torch.compile`` each converted float8 layer when the model is
            not compiled otherwise (no ``dynamo_backend``/``dynamo_plugin``); without it float8 is
            slower than bf16. Default: True on CUDA, False elsewhere (``HASTEN_FP8_AUTO_COMPILE``).

    Needs torchao (``pip install torchao``); constructing the object without it raises ImportError.
    """

    config: Any = None
    module_filter_func: Optional[Callable] = None
    pad_inner_dim: Optional[bool] = None
    enable_fsdp_float8_all_gather: Optional[bool] = None
    # hasten only; keyword-only, so a call written for Accelerate cannot shift onto it
    auto_compile: Optional[bool] = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.auto_compile is not None and not isinstance(self.auto_compile, bool):
            raise TypeError(f"AORecipeKwargs(auto_compile={self.auto_compile!r}) must be True, False or None "
                            "(None: compile the float8 layers on CUDA only)")
        if self.module_filter_func is not None and not callable(self.module_filter_func):
            raise TypeError(f"AORecipeKwargs(module_filter_func={self.module_filter_func!r}) is not callable; pass "
                            "a function (module, fqn) -> bool, or None for the default filter")
        self.config = build_ao_config(self.config, self.pad_inner_dim, self.enable_fsdp_float8_all_gather)
        self.pad_inner_dim = self.config.pad_inner_dim
        self.enable_fsdp_float8_all_gather = self.config.enable_fsdp_float8_all_gather


@dataclass
class TERecipeKwargs(KwargsHandler):
    """fp8 training with NVIDIA Transformer Engine (fields as in Accelerate; each default can come
    from ``HASTEN_FP8_<FIELD>``, e.g. ``HASTEN_FP8_FORMAT``). Needs transformer_engine and CUDA."""

    use_autocast_during_eval: Optional[bool] = None
    margin: Optional[int] = None
    interval: Optional[int] = None
    fp8_format: Optional[str] = None
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[str] = None
    override_linear_precision: Optional[tuple[bool, bool, bool]] = None
    use_mxfp8_block_scaling: Optional[bool] = None

    def __post_init__(self) -> None:
        self._check_te_fields("TERecipeKwargs")
        require_backend("TE", "TERecipeKwargs")

    def _check_te_fields(self, owner: str) -> None:
        from .environment import get_env, parse_flag

        if self.use_autocast_during_eval is None:
            self.use_autocast_during_eval = parse_flag("FP8_USE_AUTOCAST_DURING_EVAL")
        self.margin = _fp8_int(owner, "margin", self.margin, "FP8_MARGIN", 0, 0)
        self.interval = _fp8_int(owner, "interval", self.interval, "FP8_INTERVAL", 1, 1)
        self.fp8_format = _fp8_choice(owner, "fp8_format", self.fp8_format, "FP8_FORMAT", "HYBRID",
                                      ("HYBRID", "E4M3", "E5M2"))
        self.amax_history_len = _fp8_int(owner, "amax_history_len", self.amax_history_len,
                                         "FP8_AMAX_HISTORY_LEN", 1024, 1)
        self.amax_compute_algo = _fp8_choice(owner, "amax_compute_algo", self.amax_compute_algo,
                                             "FP8_AMAX_COMPUTE_ALGO", "most_recent", ("max", "most_recent"), upper=False)
        if self.override_linear_precision is None:
            joined = get_env("FP8_OVERRIDE_LINEAR_PRECISION")  # what hasten launch passes
            if joined:
                from .environment import _FALSE, _TRUE

                words = [v.strip().lower() for v in joined.split(",")]
                self.override_linear_precision = tuple(w in _TRUE if w in _TRUE | _FALSE else w for w in words)
            else:
                self.override_linear_precision = tuple(
                    parse_flag(f"FP8_OVERRIDE_{gemm}") for gemm in ("FPROP", "DGRAD", "WGRAD"))
        value = self.override_linear_precision
        if not isinstance(value, (tuple, list)) or len(value) != 3 or not all(isinstance(v, bool) for v in value):
            raise ValueError(f"{owner}(override_linear_precision={value!r}) is not valid; use three booleans "
                             "(fprop, dgrad, wgrad), e.g. (False, False, True)")
        self.override_linear_precision = tuple(value)
        if self.use_mxfp8_block_scaling is None:
            self.use_mxfp8_block_scaling = parse_flag("FP8_USE_MXFP8_BLOCK_SCALING")


@dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """fp8 training with MS-AMP. ``opt_level``: "O1" or "O2" (default; ``HASTEN_FP8_OPT_LEVEL``).
    Needs msamp and CUDA."""

    opt_level: Optional[str] = None

    def __post_init__(self) -> None:
        self._check_msamp_fields("MSAMPRecipeKwargs")
        require_backend("MSAMP", "MSAMPRecipeKwargs")

    def _check_msamp_fields(self, owner: str) -> None:
        self.opt_level = _fp8_choice(owner, "opt_level", self.opt_level, "FP8_OPT_LEVEL", "O2", ("O1", "O2"))


@dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Deprecated (as in Accelerate): use ``AORecipeKwargs``, ``TERecipeKwargs`` or ``MSAMPRecipeKwargs``.

    ``backend``: "TE", "MSAMP" or (hasten only) "AO"; default ``HASTEN_FP8_BACKEND``, else MS-AMP
    when installed, else TE. The Accelerator uses the recipe of that backend (``to_recipe()``).
    """

    backend: Optional[str] = None

    def __post_init__(self) -> None:
        import warnings

        warnings.warn("FP8RecipeKwargs is deprecated; use AORecipeKwargs (torchao), TERecipeKwargs or "
                      "MSAMPRecipeKwargs", FutureWarning, stacklevel=3)
        default = "MSAMP" if backend_installed("MSAMP") else "TE"
        self.backend = _fp8_choice("FP8RecipeKwargs", "backend", self.backend, "FP8_BACKEND", default,
                                   ("AO", "TE", "MSAMP"))
        if self.backend == "TE":
            self._check_te_fields("FP8RecipeKwargs")
        elif self.backend == "MSAMP":
            self._check_msamp_fields("FP8RecipeKwargs")
        require_backend(self.backend, f"FP8RecipeKwargs(backend={self.backend!r})")

    def to_recipe(self) -> KwargsHandler:
        """The recipe handler of ``backend`` with this object's settings."""
        if self.backend == "AO":
            return AORecipeKwargs()
        if self.backend == "MSAMP":
            return MSAMPRecipeKwargs(opt_level=self.opt_level)
        names = [f.name for f in fields(TERecipeKwargs)]
        return TERecipeKwargs(**{n: getattr(self, n) for n in names})
