"""The launcher's config file: its keys, their types and defaults, reading, checking and writing.

The file uses the keys of Accelerate's ``default_config.yaml`` (so an Accelerate config, legacy keys
included, is read as-is) plus hasten keys written only when they differ from their default
(``gradient_accumulation_steps``, ``num_cpu_threads_per_process``, ``hang_timeout``). Torch-free:
``--help`` and ``hasten config`` must stay fast.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..utils import constants
from ..files.durable import atomic_write
from ..layout import SIZED_AXES
from ..utils.dataclasses import DistributedType, DynamoBackend
from .errors import HastenCLIError, MissingFileError, did_you_mean

CONFIG_ENV = "HASTEN_CONFIG_FILE"

MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
DYNAMO_BACKENDS = tuple(b.value for b in DynamoBackend)
DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DISTRIBUTED_TYPES = tuple(t.value for t in DistributedType)
FSDP_SHARDING = tuple(constants.FSDP_SHARDING_STRATEGY)
FSDP_WRAP = tuple(constants.FSDP_AUTO_WRAP_POLICY)
FSDP_PREFETCH = tuple(constants.FSDP_BACKWARD_PREFETCH)
FSDP_STATE_DICT = tuple(constants.FSDP_STATE_DICT_TYPE)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
FP8_BACKENDS = ("AO", "TE", "MSAMP")
DS_LAUNCHERS = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm")

_TRUE = {"true", "yes", "y", "on", "1"}
_FALSE = {"false", "no", "n", "off", "0"}


@dataclass(frozen=True)
class Key:
    """One setting's type. ``kind``: int, float, bool, str, choice, port, gpu_ids, dict, list."""

    name: str
    kind: str
    default: Any = None
    choices: tuple = ()
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    help: str = ""


class BadValue(ValueError):
    """A value that cannot be read as its key's type; the caller adds where it came from."""


def coerce(key: Key, value: Any) -> Any:
    """``value`` converted to ``key``'s type (``"8"`` -> 8 for an int), or ``BadValue``."""
    if value is None:
        return None
    kind = key.kind
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise BadValue(f"{value!r} is not a yes/no value; use true or false")
    if kind in ("int", "port"):
        if isinstance(value, bool):
            raise BadValue(f"{value!r} is not a whole number")
        try:
            number = int(value) if not isinstance(value, float) or value.is_integer() else None
        except (TypeError, ValueError):
            number = None
        if number is None:
            raise BadValue(f"{value!r} is not a whole number")
        low, high = (0, 65535) if kind == "port" else (key.minimum, key.maximum)
        if low is not None and number < low or high is not None and number > high:
            span = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
            raise BadValue(f"{number} is out of range; it must be {span}")
        return number
    if kind == "float":
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise BadValue(f"{value!r} is not a number") from None
        if not math.isfinite(number):
            raise BadValue(f"{value!r} is not a finite number")
        if key.minimum is not None and number < key.minimum:
            raise BadValue(f"{value!r} is out of range; it must be at least {key.minimum:g}")
        return number
    if kind == "choice":
        text = str(value).strip()
        for choice in key.choices:
            if text.lower() == str(choice).lower():
                return choice
        hint = did_you_mean(text, [str(c) for c in key.choices])
        if hint and len(key.choices) > 6:
            raise BadValue(f"{value!r} is not a known value{hint}")
        raise BadValue(f"{value!r} is not one of {', '.join(map(str, key.choices))}{hint}")
    if kind == "gpu_ids":
        return normalize_gpu_ids(value)
    if kind == "dict":
        if not isinstance(value, Mapping):
            raise BadValue(f"{value!r} is not a mapping of keys to values")
        return dict(value)
    if kind == "list":
        if not isinstance(value, (list, tuple)):
            raise BadValue(f"{value!r} is not a list")
        return list(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
        return ",".join(str(v) for v in value)  # e.g. layer class names given as a YAML list
    if isinstance(value, (dict, list, tuple)):
        raise BadValue(f"{value!r} is not a single value")
    return str(value)


def normalize_gpu_ids(value: Any) -> str:
    """``"all"``, ``0``, ``[0, 1]``, ``"0, 1"`` -> ``"all"`` / ``"0"`` / ``"0,1"``."""
    if isinstance(value, bool):
        raise BadValue(f"{value!r} is not a list of GPU ids; use all or e.g. 0,1")
    if isinstance(value, (list, tuple)):
        parts = [str(v).strip() for v in value]
    else:
        text = str(value).strip()
        if text.lower() == "all":
            return "all"
        parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise BadValue(f"{value!r} is not a list of GPU ids; use all or comma-separated numbers such as 0,1")
    if len(set(parts)) != len(parts):
        raise BadValue(f"{value!r} names a GPU twice")
    return ",".join(str(int(p)) for p in parts)


def _keys(*keys: Key) -> dict[str, Key]:
    return {k.name: k for k in keys}


# Top-level keys (Accelerate's names). None default = unset.
TOP = _keys(
    Key("compute_environment", "choice", "LOCAL_MACHINE", ("LOCAL_MACHINE", "AMAZON_SAGEMAKER")),
    Key("distributed_type", "choice", "NO", DISTRIBUTED_TYPES + ("TPU",)),
    Key("mixed_precision", "choice", "no", MIXED_PRECISION),
    Key("use_cpu", "bool", False),
    Key("debug", "bool", False),
    Key("num_processes", "int", None, minimum=-1),
    Key("num_machines", "int", 1, minimum=1),
    Key("machine_rank", "int", 0, minimum=0),
    Key("gpu_ids", "gpu_ids", None),
    Key("main_process_ip", "str", None),
    Key("main_process_port", "port", None),
    Key("rdzv_backend", "choice", "static", RDZV_BACKENDS),
    Key("same_network", "bool", True),
    Key("main_training_function", "str", "main"),
    Key("enable_cpu_affinity", "bool", False),
    Key("downcast_bf16", "bool", False),
    Key("dynamo_config", "dict", None),
    Key("fsdp_config", "dict", None),
    Key("deepspeed_config", "dict", None),
    Key("fp8_config", "dict", None),
    Key("parallelism_config", "dict", None),
    Key("megatron_lm_config", "dict", None),
    Key("mpirun_config", "dict", None),
    Key("tpu_name", "str", None),
    Key("tpu_zone", "str", None),
    Key("tpu_use_cluster", "bool", False),
    Key("tpu_use_sudo", "bool", False),
    Key("tpu_vm", "list", None),
    Key("tpu_env", "list", None),
    Key("command_file", "str", None),
    Key("commands", "list", None),
    # hasten's own keys (written only when not default)
    Key("gradient_accumulation_steps", "int", 1, minimum=1),
    Key("num_cpu_threads_per_process", "int", None, minimum=1),
    Key("hang_timeout", "float", 300.0, minimum=0),
)

# Keys Accelerate used to write; read and converted, never written.
LEGACY = {"fp16", "dynamo_backend", "ipex_config", "use_ipex"}

SECTIONS: dict[str, dict[str, Key]] = {
    "dynamo_config": _keys(
        Key("dynamo_backend", "choice", "NO", DYNAMO_BACKENDS),
        Key("dynamo_mode", "choice", "default", DYNAMO_MODES),
        Key("dynamo_use_fullgraph", "bool", False),
        Key("dynamo_use_dynamic", "bool", False),
        Key("dynamo_use_regional_compilation", "bool", False),
    ),
    "fsdp_config": _keys(
        Key("fsdp_version", "int", 1, minimum=1, maximum=2),
        Key("fsdp_sharding_strategy", "choice", "FULL_SHARD", FSDP_SHARDING),
        Key("fsdp_reshard_after_forward", "str", None),
        Key("fsdp_offload_params", "bool", False),
        Key("fsdp_min_num_params", "int", 100_000_000, minimum=0),
        Key("fsdp_auto_wrap_policy", "choice", None, FSDP_WRAP),
        Key("fsdp_transformer_layer_cls_to_wrap", "str", None),
        Key("fsdp_backward_prefetch", "choice", None, FSDP_PREFETCH),
        Key("fsdp_backward_prefetch_policy", "choice", None, FSDP_PREFETCH),  # legacy name
        Key("fsdp_state_dict_type", "choice", "FULL_STATE_DICT", FSDP_STATE_DICT),
        Key("fsdp_forward_prefetch", "bool", False),
        Key("fsdp_use_orig_params", "bool", True),
        Key("fsdp_cpu_ram_efficient_loading", "bool", True),
        Key("fsdp_sync_module_states", "bool", True),
        Key("fsdp_activation_checkpointing", "bool", False),
        Key("fsdp_activation_checkpointing_offload", "bool", False),
        Key("fsdp_ignored_modules", "str", None),
    ),
    "parallelism_config": _keys(
        *(Key(f"parallelism_config_{axis}_size", "int", None, minimum=1) for axis in SIZED_AXES),  # hasten.layout
        Key("parallelism_config_cp_backend", "choice", None, ("torch",)),
        Key("parallelism_config_cp_comm_strategy", "str", None),
        Key("parallelism_config_sp_backend", "choice", None, ("hasten", "deepspeed")),
        # Checked (with did-you-mean) by ParallelismConfig's own rule when hasten launch reads it.
        Key("parallelism_config_pp_schedule", "str", None),
        Key("parallelism_config_pp_microbatches", "int", None, minimum=1),
        Key("parallelism_config_pp_stages_per_rank", "int", None, minimum=1),
        Key("parallelism_config_pp_split_points", "str", None),  # comma-separated, or a YAML list
    ),
    "deepspeed_config": _keys(
        Key("deepspeed_config_file", "str", None),
        Key("zero_stage", "int", 2, minimum=0, maximum=3),
        Key("gradient_accumulation_steps", "int", 1, minimum=1),
        Key("gradient_clipping", "float", None, minimum=0),
        Key("offload_optimizer_device", "choice", "none", OFFLOAD_DEVICES),
        Key("offload_param_device", "choice", "none", OFFLOAD_DEVICES),
        Key("offload_optimizer_nvme_path", "str", None),
        Key("offload_param_nvme_path", "str", None),
        Key("zero3_init_flag", "bool", False),
        Key("zero3_save_16bit_model", "bool", False),
        Key("deepspeed_hostfile", "str", None),
        Key("deepspeed_exclusion_filter", "str", None),
        Key("deepspeed_inclusion_filter", "str", None),
        Key("deepspeed_multinode_launcher", "choice", None, DS_LAUNCHERS),
        Key("deepspeed_moe_layer_cls_names", "str", None),
    ),
    # Accelerate's fp8 keys (its questionnaire writes the three legacy spellings in FP8_LEGACY).
    "fp8_config": _keys(
        Key("backend", "choice", None, FP8_BACKENDS),
        Key("use_autocast_during_eval", "bool", None),
        Key("margin", "int", None, minimum=0),
        Key("interval", "int", None, minimum=1),
        Key("fp8_format", "choice", None, ("HYBRID", "E4M3", "E5M2")),
        Key("amax_history_len", "int", None, minimum=1),
        Key("amax_compute_algo", "choice", None, ("max", "most_recent")),
        Key("override_linear_precision", "str", None),
        Key("opt_level", "choice", None, ("O1", "O2")),
        Key("enable_fsdp_float8_all_gather", "bool", None),
        Key("pad_inner_dim", "bool", None),
    ),
}
FP8_LEGACY = {"amax_history_length": "amax_history_len", "amax_compute_algorithm": "amax_compute_algo",
              "optimization_level": "opt_level"}
# Sections hasten stores but does not read yet: any content is kept as-is.
FREE_SECTIONS = {"megatron_lm_config", "mpirun_config", "ipex_config"}

# What `hasten config` writes, in this order (sorted, like Accelerate's files).
WRITTEN = (
    "compute_environment", "debug", "deepspeed_config", "distributed_type", "downcast_bf16", "dynamo_config",
    "enable_cpu_affinity", "fsdp_config", "gpu_ids", "machine_rank", "main_process_ip", "main_process_port",
    "main_training_function", "mixed_precision", "num_machines", "num_processes", "rdzv_backend",
    "same_network", "use_cpu",
)


def default_config_path(environ: Optional[Mapping[str, str]] = None) -> str:
    """``$HASTEN_CONFIG_FILE``, else ``~/.cache/hasten/default_config.yaml``."""
    env = os.environ if environ is None else environ
    if env.get(CONFIG_ENV):
        return os.path.expanduser(env[CONFIG_ENV])
    return os.path.join(os.path.expanduser("~"), ".cache", "hasten", "default_config.yaml")


def _fail(where: str, key: str, problem: str) -> HastenCLIError:
    return HastenCLIError(f"{where}: {key}: {problem}")


def validate(raw: Any, where: str = "config") -> dict[str, Any]:
    """Check a loaded config mapping and return it normalised (legacy keys converted).

    Raises ``HastenCLIError`` naming the key: unknown keys (with a did-you-mean), values of the
    wrong type (``"8"`` for an int is coerced), and settings that contradict each other.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise HastenCLIError(f"{where}: the file must hold a mapping of keys to values, not {type(raw).__name__}")
    data = dict(raw)
    out: dict[str, Any] = {}
    if str(data.get("compute_environment", "")).upper() == "AMAZON_SAGEMAKER":
        raise HastenCLIError(
            f"{where}: compute_environment: AMAZON_SAGEMAKER is not supported by hasten; "
            "use LOCAL_MACHINE (and launch inside the SageMaker job with hasten launch)"
        )
    # Legacy keys first, so that the new key wins when both are present.
    if "fp16" in data:
        fp16 = _coerce_at(Key("fp16", "bool"), data.pop("fp16"), where, "fp16")
        if fp16 and data.get("mixed_precision") in (None, "no"):
            data["mixed_precision"] = "fp16"
    if "dynamo_backend" in data:
        backend = data.pop("dynamo_backend")
        section = dict(data.get("dynamo_config") or {})
        section.setdefault("dynamo_backend", backend)
        data["dynamo_config"] = section
    for legacy in ("ipex_config", "use_ipex"):
        data.pop(legacy, None)
    for name, value in data.items():
        if not isinstance(name, str) or name not in TOP:
            hint = did_you_mean(str(name), list(TOP))
            raise HastenCLIError(f"{where}: unknown key {name!r}{hint or '; remove it'}")
        key = TOP[name]
        if name == "mixed_precision" and value is None:
            value = "no"
        value = _coerce_at(key, value, where, name)
        if name in SECTIONS:
            value = _validate_section(name, value or {}, where)
        if name == "num_processes" and value == -1:
            value = None  # Accelerate writes -1 for "not set"
        elif name == "num_processes" and value is not None and value < 1:
            raise _fail(where, name, f"{value} must be at least 1")
        if value is not None:
            out[name] = value
    if out.get("distributed_type") == "TPU":
        out["distributed_type"] = "XLA"
    _check_consistency(out, where)
    return out


def _coerce_at(key: Key, value: Any, where: str, path: str) -> Any:
    try:
        return coerce(key, value)
    except BadValue as exc:
        raise _fail(where, path, str(exc)) from None


def _validate_section(name: str, section: dict, where: str) -> dict:
    known = SECTIONS[name]
    out = {}
    for key, value in section.items():
        if name == "fp8_config" and key in FP8_LEGACY and FP8_LEGACY[key] not in section:
            key = FP8_LEGACY[key]
        if key not in known:
            hint = did_you_mean(str(key), list(known))
            raise HastenCLIError(f"{where}: unknown key {name}.{key}{hint or '; remove it'}")
        if key == "dynamo_backend" and str(value).upper() == "NO":
            value = "NO"
        if key == "fsdp_sharding_strategy" and isinstance(value, int) and 1 <= value <= len(FSDP_SHARDING):
            value = FSDP_SHARDING[value - 1]  # very old files stored the enum's number
        coerced = _coerce_at(known[key], value, where, f"{name}.{key}")
        if coerced is not None:
            out[key] = coerced
    return out


def _check_consistency(cfg: dict, where: str) -> None:
    dtype = cfg.get("distributed_type", "NO")
    if cfg.get("use_cpu") and dtype in ("MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU"):
        raise HastenCLIError(
            f"{where}: use_cpu: true contradicts distributed_type: {dtype}; "
            "set use_cpu: false or distributed_type: MULTI_CPU"
        )
    machines = cfg.get("num_machines", 1)
    if cfg.get("machine_rank", 0) >= machines:
        raise HastenCLIError(
            f"{where}: machine_rank: {cfg['machine_rank']} must be below num_machines ({machines}); "
            "machines are numbered from 0"
        )
    procs = cfg.get("num_processes")
    if procs is not None and procs % machines:
        raise HastenCLIError(
            f"{where}: num_processes: {procs} (all machines together) is not a multiple of num_machines ({machines})"
        )
    ids = cfg.get("gpu_ids")
    if procs is not None and ids not in (None, "all") and dtype in ("MULTI_GPU", "FSDP", "DEEPSPEED") \
            and not cfg.get("use_cpu") and len(ids.split(",")) != procs // machines:
        raise HastenCLIError(
            f"{where}: gpu_ids: {ids} lists {len(ids.split(','))} GPU(s) but num_processes gives "
            f"{procs // machines} process(es) per machine; make them agree"
        )


def read_config(path: str, where: Optional[str] = None) -> dict[str, Any]:
    """Load and validate a YAML (or JSON) config file."""
    import yaml  # ~20 ms; only the commands that read a config pay for it

    where = where or f"config file {path}"
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise MissingFileError(f"{where} does not exist; create one with `hasten config` "
                             "or pass another --config_file") from None
    except IsADirectoryError:
        raise HastenCLIError(f"{where} is a directory; give the path of a YAML file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise HastenCLIError(f"{where} is not valid YAML{at}: {problem}") from None
    return validate(raw, where)


def to_yaml_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The mapping ``hasten config`` writes: Accelerate's keys, then hasten's non-default ones."""
    out: dict[str, Any] = {}
    for name in WRITTEN:
        value = cfg.get(name, TOP[name].default)
        if name == "downcast_bf16":
            value = "yes" if value else "no"  # Accelerate's questionnaire writes the strings
        elif name in SECTIONS or name in FREE_SECTIONS:
            value = dict(value or {})
        elif name == "gpu_ids" and value is None:
            continue
        out[name] = value
    for name in ("fp8_config", "parallelism_config", "megatron_lm_config", "mpirun_config", "tpu_name", "tpu_zone",
                 "tpu_vm", "tpu_env", "command_file", "commands"):
        if cfg.get(name):
            out[name] = cfg[name]
    for name in ("tpu_use_cluster", "tpu_use_sudo"):
        if cfg.get(name):
            out[name] = True
    for name in ("gradient_accumulation_steps", "num_cpu_threads_per_process", "hang_timeout"):
        if cfg.get(name) not in (None, TOP[name].default):
            out[name] = cfg[name]
    return out


def write_config(path: str, cfg: Mapping[str, Any]) -> str:
    """Write ``cfg`` as YAML atomically (temp file + rename); returns the path."""
    return dump_yaml_atomically(path, to_yaml_dict(validate(dict(cfg), "config to write")))


def dump_yaml_atomically(path: str, data: Mapping[str, Any], flag: str = "--config_file") -> str:
    """Write ``data`` as YAML to ``path`` through a temp file and a rename; returns the absolute path.
    ``flag`` is the option an error message tells the user to change."""
    import yaml

    path = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise HastenCLIError(f"cannot write the config file {path}: {exc.strerror}; pass another {flag}") from None
    with atomic_write(path, "w") as f:
        yaml.safe_dump(data, f, default_flow_style=False, sort_keys=False)
    return path
