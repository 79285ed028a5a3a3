"""``FullyShardedDataParallelPlugin``: Accelerate's FSDP settings, resolved for FSDP2 (torch-free).

Fields left as None are read from the ``FSDP_*`` environment that ``hasten launch --use_fsdp``
(and ``accelerate launch``) set from the ``fsdp_config:`` section or ``--fsdp_*`` flags.
hasten trains with FSDP2 (``torch.distributed.fsdp.fully_shard``) only: ``fsdp_version=1``
settings that have an FSDP2 meaning are translated (with one note listing them), the others
raise an error naming the setting.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

from ..warning_kinds import HastenWarning
from . import constants

_WRAPS = tuple(constants.FSDP_AUTO_WRAP_POLICY)
_STATE_DICTS = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
# torch's StateDictType numbers them 1 (full), 2 (local), 3 (sharded); Accelerate accepts the number too.
_STATE_DICT_NUMBERS = {"1": "FULL_STATE_DICT", "2": "LOCAL_STATE_DICT", "3": "SHARDED_STATE_DICT"}


def _state_dict_kind(value: Any) -> str:
    """A name, a number or torch's ``StateDictType`` member as the upper-case name."""
    name = getattr(value, "name", None)  # an enum member (torch.distributed.fsdp.StateDictType)
    text = str(name if isinstance(name, str) else value).strip().upper()
    return _STATE_DICT_NUMBERS.get(text, text)


def _flag(name: str, value: Any, default: bool = False) -> bool:
    from .environment import _FALSE, _TRUE

    if value is None:
        value = os.environ.get("FSDP_" + name.upper(), default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"FullyShardedDataParallelPlugin: {name}={value!r} is not a boolean; use true or false")


def offloads_to_cpu(cpu_offload: Any) -> bool:
    """Whether a plugin's ``cpu_offload`` (a bool, or a torch ``OffloadPolicy`` object) keeps shards on CPU."""
    if cpu_offload is None or isinstance(cpu_offload, bool):
        return bool(cpu_offload)
    from torch.distributed.fsdp import CPUOffloadPolicy  # of the policy objects, only this one offloads

    return isinstance(cpu_offload, CPUOffloadPolicy)


def _env(name: str, value: Any) -> Any:
    return os.environ.get("FSDP_" + name.upper()) if value is None else value


@dataclass
class FullyShardedDataParallelPlugin:
    """Shard parameters, gradients and optimizer state over processes with FSDP2.

    Args (Accelerate's names and defaults):
        fsdp_version: 2 (1 is translated where FSDP2 has the same meaning).
        reshard_after_forward: free the gathered parameters after forward (True) or keep them
            until backward (False, more memory, fewer all-gathers).
        auto_wrap_policy: "TRANSFORMER_BASED_WRAP" (shard each layer of the classes in
            ``transformer_cls_names_to_wrap``, else the model's ``_no_split_modules``),
            "SIZE_BASED_WRAP" (each submodule of at least ``min_num_params`` parameters),
            "NO_WRAP" (the whole model as one group), or a callable ``policy(module) -> bool``.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory
            (``offload_params`` is Accelerate's YAML name for it).
        mixed_precision_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, a dict of
            its fields, or a dtype name ("bf16"/"fp16"); default from ``mixed_precision``.
        state_dict_type: "FULL_STATE_DICT" or "SHARDED_STATE_DICT" (what ``get_state_dict``-style
            helpers return by default; ``save_state`` always writes sharded DCP files).
        activation_checkpointing: recompute the wrapped layers' activations in backward (other
            modes, and checkpointing without FSDP: ``ActivationCheckpointingKwargs``).
        activation_checkpointing_offload: with ``activation_checkpointing``, keep the checkpointed
            layers' inputs in host memory until backward.
        cpu_ram_efficient_loading: only process 0 holds real weights (the others build the model
            on ``meta``, e.g. under ``init_empty_weights()``); they receive them after sharding.
        ignored_modules: modules (or a regex of module names) left unsharded.
    """

    fsdp_version: Optional[int] = None
    sharding_strategy: Any = None
    reshard_after_forward: Union[bool, str, None] = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Union[str, Callable, None] = None
    cpu_offload: Union[bool, Any, None] = None
    ignored_modules: Union[Iterable[Any], str, None] = None
    state_dict_type: Optional[str] = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: Optional[bool] = None
    param_init_fn: Optional[Callable] = None
    sync_module_states: Optional[bool] = None
    forward_prefetch: Optional[bool] = None
    activation_checkpointing: Optional[bool] = None
    activation_checkpointing_offload: Optional[bool] = None
    cpu_ram_efficient_loading: Optional[bool] = None
    transformer_cls_names_to_wrap: Optional[list[str]] = None
    min_num_params: Optional[int] = None
    notes: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        version = _env("version", self.fsdp_version)
        version = 1 if version is None else version
        if str(version) not in ("1", "2"):
            raise ValueError(f"FullyShardedDataParallelPlugin: fsdp_version={version!r}; use 2 (or 1, translated to FSDP2)")
        self.fsdp_version = int(version)
        if self.fsdp_version == 1:
            self._translate_fsdp1()
        self.reshard_after_forward = _flag("reshard_after_forward", self.reshard_after_forward, True)
        if self.cpu_offload is None:
            self.cpu_offload = _flag("offload_params", None)
        elif not isinstance(self.cpu_offload, bool):  # a CPUOffloadPolicy/OffloadPolicy object: used as given
            pass
        policy = _env("auto_wrap_policy", self.auto_wrap_policy) or "NO_WRAP"
        if isinstance(policy, str):
            policy = policy.upper()
            if policy not in _WRAPS:
                raise ValueError(f"FullyShardedDataParallelPlugin: auto_wrap_policy={policy!r}; use one of {list(_WRAPS)} "
                                 "or a callable policy(module) -> bool")
        elif not callable(policy):
            raise TypeError(f"FullyShardedDataParallelPlugin: auto_wrap_policy={policy!r} is neither a name nor a callable")
        self.auto_wrap_policy = policy
        names = _env("transformer_cls_to_wrap", self.transformer_cls_names_to_wrap)
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        self.transformer_cls_names_to_wrap = list(names) if names else None
        size = _env("min_num_params", self.min_num_params)
        try:
            self.min_num_params = int(size) if size is not None else 0
        except (TypeError, ValueError):
            raise ValueError(f"FullyShardedDataParallelPlugin: min_num_params={size!r} must be an integer") from None
        kind = _state_dict_kind(_env("state_dict_type", self.state_dict_type) or "FULL_STATE_DICT")
        if kind not in _STATE_DICTS:
            raise ValueError(f"FullyShardedDataParallelPlugin: state_dict_type={kind!r}; FSDP2 offers {list(_STATE_DICTS)}")
        self.state_dict_type = kind
        self.activation_checkpointing = _flag("activation_checkpointing", self.activation_checkpointing)
        self.activation_checkpointing_offload = _flag("activation_checkpointing_offload",
                                                      self.activation_checkpointing_offload)
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise ValueError("FullyShardedDataParallelPlugin: activation_checkpointing_offload=True needs "
                             "activation_checkpointing=True (it offloads what the checkpointed layers keep)")
        self.cpu_ram_efficient_loading = _flag("cpu_ram_efficient_loading", self.cpu_ram_efficient_loading)
        if self.ignored_modules is None:
            self.ignored_modules = os.environ.get("FSDP_IGNORED_MODULES") or None
        if self.param_init_fn is not None:
            raise ValueError("FullyShardedDataParallelPlugin: param_init_fn is an FSDP1 setting; with FSDP2 build the "
                             "model under init_empty_weights() and set cpu_ram_efficient_loading=True")
        if self.notes:
            warnings.warn("FullyShardedDataParallelPlugin: fsdp_version=1 settings translated to FSDP2: "
                          + "; ".join(self.notes), HastenWarning, stacklevel=3)

    def set_auto_wrap_policy(self, model: Any) -> None:
        """Check the wrap policy against ``model`` before ``prepare`` (Accelerate's method): with
        ``TRANSFORMER_BASED_WRAP`` the block classes default to the model's ``_no_split_modules`` and each
        must occur in the model. The policy stays a name; ``prepare`` applies it."""
        if self.auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
            return
        if self.transformer_cls_names_to_wrap is None:
            self.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])
        present = {cls.__name__ for module in model.modules() for cls in type(module).__mro__}
        absent = [name for name in self.transformer_cls_names_to_wrap if name not in present]
        if absent:
            raise ValueError(f"FullyShardedDataParallelPlugin: transformer_cls_names_to_wrap names {absent[0]!r}, "
                             f"which is not a class of any module of the model; use a class name of its blocks")

    def _translate_fsdp1(self) -> None:
        """FSDP1 settings with an FSDP2 meaning become that meaning; the others are refused."""
        strategy = _env("sharding_strategy", self.sharding_strategy)
        reshard = _env("reshard_after_forward", self.reshard_after_forward)
        if strategy is None and isinstance(reshard, str) and reshard.upper() in ("FULL_SHARD", "SHARD_GRAD_OP",
                                                                                   "NO_SHARD", "HYBRID_SHARD",
                                                                                   "HYBRID_SHARD_ZERO2"):
            strategy, reshard = reshard, None
        if strategy is not None:
            name = getattr(strategy, "name", str(strategy)).upper()
            name = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD"}.get(name, name)
            if name == "FULL_SHARD":
                self.reshard_after_forward = True
            elif name == "SHARD_GRAD_OP":
                self.reshard_after_forward = False
            else:
                raise ValueError(f"FullyShardedDataParallelPlugin: sharding_strategy={name!r} has no FSDP2 translation in "
                                 "hasten; use FULL_SHARD or SHARD_GRAD_OP (NO_SHARD: train with DDP, i.e. without --use_fsdp)")
            self.notes.append(f"sharding_strategy={name} -> reshard_after_forward={self.reshard_after_forward}")
        else:
            self.reshard_after_forward = reshard
        prefetch = _env("backward_prefetch", self.backward_prefetch)
        if prefetch is not None:
            name = getattr(prefetch, "name", str(prefetch)).upper()
            if name not in ("BACKWARD_PRE", "NO_PREFETCH"):
                raise ValueError(f"FullyShardedDataParallelPlugin: backward_prefetch={name!r} has no FSDP2 equivalent "
                                 "(FSDP2 always prefetches before backward); remove it or use BACKWARD_PRE")
            self.notes.append(f"backward_prefetch={name} -> FSDP2's own prefetching")
        self.backward_prefetch = None
        if _flag("forward_prefetch", self.forward_prefetch):
            raise ValueError("FullyShardedDataParallelPlugin: forward_prefetch=True has no FSDP2 equivalent in hasten; "
                             "set it to false")
        self.forward_prefetch = None
        if self.use_orig_params is not None or os.environ.get("FSDP_USE_ORIG_PARAMS"):
            self.notes.append("use_orig_params -> always on in FSDP2")
        self.use_orig_params = None
        if _flag("sync_module_states", self.sync_module_states):
            self.notes.append("sync_module_states -> process 0's weights are broadcast (cpu_ram_efficient_loading)")
            if self.cpu_ram_efficient_loading is None and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING") is None:
                self.cpu_ram_efficient_loading = True
        self.sync_module_states = None
        self.fsdp_version = 2
