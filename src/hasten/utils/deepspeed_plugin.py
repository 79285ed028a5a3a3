"""``DeepSpeedPlugin``: Accelerate's DeepSpeed settings as one DeepSpeed config dict (torch-free).

Fields left as None come from the ``HASTEN_DEEPSPEED_*`` (else ``ACCELERATE_DEEPSPEED_*``)
environment that ``hasten launch --use_deepspeed`` and ``accelerate launch`` set. With a JSON
file (``hf_ds_config``) the file is the configuration: fields given explicitly to the plugin fill
its ``"auto"`` values and must agree with its concrete ones. ``resolve`` fills the remaining
``"auto"`` values from the script (batch size, accumulation, clipping, optimizer, precision);
a value the script contradicts is one error naming both.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .environment import _FALSE, _TRUE, get_env

AUTO = "auto"
# plugin field -> dotted key of the DeepSpeed config
_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
_ENV = {
    "gradient_accumulation_steps": "GRADIENT_ACCUMULATION_STEPS", "gradient_clipping": "GRADIENT_CLIPPING",
    "zero_stage": "DEEPSPEED_ZERO_STAGE", "offload_optimizer_device": "DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_save_16bit_model": "DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "zero3_init_flag": "DEEPSPEED_ZERO3_INIT",
    "hf_ds_config": "DEEPSPEED_CONFIG_FILE", "transformer_moe_cls_names": "DEEPSPEED_MOE_LAYER_CLS_NAMES",
}
_DEVICES = ("none", "cpu", "nvme")


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"DeepSpeedPlugin: {name}={value!r} is not a boolean; use true or false")


def get_path(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_path(config: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = config
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _same(a: Any, b: Any) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a).lower() == str(b).lower()


def fill(config: dict, dotted: str, value: Any, source: str, where: str = "the DeepSpeed config") -> None:
    """Put ``value`` (from ``source``) at ``dotted``: fills "auto" or a missing key, agrees with a set one."""
    current = get_path(config, dotted)
    if current is None or current == AUTO:
        set_path(config, dotted, value)
    elif not _same(current, value):
        raise ValueError(f"{where} sets {dotted}={current!r} but {source} gives {value!r}; make them agree "
                         f"(or write \"{dotted.split('.')[-1]}\": \"auto\" in the JSON to take the script's value)")


@dataclass
class DeepSpeedPlugin:
    """Train with DeepSpeed ZeRO (stages 0-3).

    Args (Accelerate's names):
        hf_ds_config: a DeepSpeed JSON file path or dict; when given it is the configuration and
            the other fields only fill its "auto" values (and must agree with the rest).
        gradient_accumulation_steps: micro-steps per optimizer step (default: the Accelerator's).
        gradient_clipping: clip the global gradient norm at this value (DeepSpeed clips in its step).
        zero_stage: 0, 1, 2 or 3 (default 2).
        offload_optimizer_device / offload_param_device: "none", "cpu" or "nvme" (params: stage 3).
        offload_optimizer_nvme_path / offload_param_nvme_path: folders for nvme offload.
        zero3_init_flag: build ``transformers`` models partitioned from the start (stage 3).
        zero3_save_16bit_model: keep ZeRO-3's gathered 16-bit weights on ``save_model``.
        transformer_moe_cls_names: comma-separated MoE layer class names (ZeRO-3 leaf modules).
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: Any = None
    gradient_clipping: Any = None
    zero_stage: Optional[int] = None
    is_train_batch_min: bool = True
    offload_optimizer_device: Optional[str] = None
    offload_param_device: Optional[str] = None
    offload_optimizer_nvme_path: Optional[str] = None
    offload_param_nvme_path: Optional[str] = None
    zero3_init_flag: Optional[bool] = None
    zero3_save_16bit_model: Optional[bool] = None
    transformer_moe_cls_names: Optional[str] = None
    deepspeed_config: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        explicit = {k for k in _KEYS if getattr(self, k) is not None}
        # Launcher settings are defaults: the script's own Accelerator arguments override them.
        self.soft_fields = {k for k in _KEYS if k not in explicit and get_env(_ENV[k]) is not None}
        for name, env in _ENV.items():
            if getattr(self, name) is None:
                setattr(self, name, get_env(env))
        self.zero3_init_flag = _bool("zero3_init_flag", self.zero3_init_flag or False)
        self.zero3_save_16bit_model = _bool("zero3_save_16bit_model", self.zero3_save_16bit_model or False)
        for name in ("gradient_accumulation_steps", "zero_stage"):
            value = getattr(self, name)
            if value is not None and value != AUTO:
                try:
                    setattr(self, name, int(value))
                except (TypeError, ValueError):
                    raise ValueError(f"DeepSpeedPlugin: {name}={value!r} is not an integer") from None
        if self.gradient_clipping not in (None, AUTO):
            try:
                self.gradient_clipping = float(self.gradient_clipping)
            except (TypeError, ValueError):
                raise ValueError(f"DeepSpeedPlugin: gradient_clipping={self.gradient_clipping!r} is not a number")
        source = self.hf_ds_config
        if source in (None, "", "none"):
            self.deepspeed_config = self._from_fields()
        else:
            self.deepspeed_config = self._from_json(source, explicit)
        self._check()
        # Read back what the file decided, so the plugin's fields describe the run.
        for name, dotted in _KEYS.items():
            value = get_path(self.deepspeed_config, dotted)
            if value is not None and value != AUTO:
                setattr(self, name, value)

    def _from_fields(self) -> dict[str, Any]:
        stage = 2 if self.zero_stage is None else self.zero_stage
        opt_dev = (self.offload_optimizer_device or "none").lower()
        par_dev = (self.offload_param_device or "none").lower()
        zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": opt_dev},
                                "offload_param": {"device": par_dev},
                                "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model}
        if opt_dev == "nvme":
            zero["offload_optimizer"]["nvme_path"] = self.offload_optimizer_nvme_path
        if par_dev == "nvme":
            zero["offload_param"]["nvme_path"] = self.offload_param_nvme_path
        return {
            "train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO,
            "gradient_accumulation_steps": self.gradient_accumulation_steps or AUTO,
            "gradient_clipping": AUTO if self.gradient_clipping is None else self.gradient_clipping,
            "zero_optimization": zero,
        }

    def _from_json(self, source: Any, explicit: set) -> dict[str, Any]:
        if isinstance(source, dict):
            config, where = copy.deepcopy(source), "hf_ds_config"
        elif isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            if not os.path.isfile(path):
                raise ValueError(f"DeepSpeedPlugin: hf_ds_config={path!r} is not a file; give the path of a DeepSpeed "
                                 "JSON file or a dict")
            try:
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"DeepSpeedPlugin: {path} is not valid JSON ({e})") from None
            where = path
        elif hasattr(source, "config") and isinstance(source.config, dict):  # transformers' HfDeepSpeedConfig
            config, where = copy.deepcopy(source.config), "hf_ds_config"
        else:
            raise ValueError(f"DeepSpeedPlugin: hf_ds_config={type(source).__name__} is neither a path nor a dict")
        if not isinstance(config.get("zero_optimization"), dict):
            raise ValueError(f"{where} has no \"zero_optimization\" section; add one, e.g. "
                             "\"zero_optimization\": {\"stage\": 2}")
        config.setdefault("gradient_accumulation_steps", AUTO)
        for name in sorted(explicit):  # what the script gave the plugin outright
            fill(config, _KEYS[name], getattr(self, name), f"DeepSpeedPlugin({name}=...)", where)
        self.config_source = where
        self.soft_fields = set()  # the file decides; the launcher's other flags do not apply
        return config

    def _check(self) -> None:
        cfg = self.deepspeed_config
        stage = get_path(cfg, "zero_optimization.stage")
        if stage is not None and stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage={stage!r}; use 0, 1, 2 or 3")
        for what in ("offload_optimizer", "offload_param"):
            device = get_path(cfg, f"zero_optimization.{what}.device")
            if device is not None and str(device).lower() not in _DEVICES:
                raise ValueError(f"zero_optimization.{what}.device={device!r}; use one of {', '.join(_DEVICES)}")
            if str(device).lower() == "nvme" and not get_path(cfg, f"zero_optimization.{what}.nvme_path"):
                raise ValueError(f"zero_optimization.{what}.device='nvme' needs a folder: set {what}_nvme_path")
        if str(get_path(cfg, "zero_optimization.offload_param.device")).lower() in ("cpu", "nvme") and stage != 3:
            raise ValueError(f"offload_param_device needs zero_stage=3 (it is {stage}); offload the optimizer "
                             "(offload_optimizer_device) at stages 1-2")

    # Whether this plugin is the active one of the run (``AcceleratorState.select_deepspeed_plugin``).
    _selected: bool = field(default=False, init=False, repr=False, compare=False)

    def select(self, _from_accelerator_state: bool = False) -> None:
        """Make this plugin the active one; only ``AcceleratorState().select_deepspeed_plugin(name)``
        may, since the state must know which one is active."""
        if not _from_accelerator_state:
            raise ValueError("a DeepSpeedPlugin is selected through the state: call "
                             "accelerator.state.select_deepspeed_plugin(name) with the name given in deepspeed_plugins")
        self._selected = True

    def _unselect(self) -> None:
        self._selected = False

    @property
    def selected(self) -> bool:
        """Whether ``prepare`` builds the next models with this plugin's config."""
        return self._selected

    @selected.setter
    def selected(self, value: bool) -> None:
        raise NotImplementedError("DeepSpeedPlugin.selected is read-only; call "
                                  "accelerator.state.select_deepspeed_plugin(name)")

    @property
    def zero_stage_value(self) -> int:
        return int(get_path(self.deepspeed_config, "zero_optimization.stage") or 0)

    def leaf_modules(self) -> list[str]:
        """The MoE class names given in ``transformer_moe_cls_names``."""
        return [n.strip() for n in (self.transformer_moe_cls_names or "").split(",") if n.strip()]
