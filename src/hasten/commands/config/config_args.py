"""The launch config file as dataclasses, under Accelerate's names (``ClusterConfig``, ``SageMakerConfig``,
``load_config_from_file``), for code that reads or writes config files from Python.

A local-machine file is read and checked by the same code as ``hasten launch`` reads it
(``config_schema.read_config``: unknown keys and bad values are refused, legacy keys converted), so
what loads here is what the launcher accepts. A SageMaker file is only read and written: hasten does
not launch on SageMaker (``hasten launch`` refuses such a file and says what to use instead).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Optional, Union

from ...utils.constants import SAGEMAKER_PYTHON_VERSION, SAGEMAKER_PYTORCH_VERSION, SAGEMAKER_TRANSFORMERS_VERSION
from ...utils.dataclasses import DistributedType
from ...utils.kinds import ComputeEnvironment, SageMakerDistributedType
from ..config_schema import TOP, default_config_path, read_config, write_config
from .default import default_config_file

default_yaml_config_file = default_config_file
default_json_config_file = default_config_file  # Accelerate's old JSON name; both mean the one default file
cache_dir = os.path.dirname(default_config_file)


def _default_file() -> str:
    # $HASTEN_CONFIG_FILE set after import still counts, as it does for `hasten launch`.
    return default_config_path()


def _read_raw(path: str) -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)  # JSON is YAML too
    if not isinstance(raw, dict):
        raise ValueError(f"the config file {path} must hold a mapping of keys to values, not {type(raw).__name__}")
    return raw


def load_config_from_file(config_file: Optional[str] = None) -> Union["ClusterConfig", "SageMakerConfig"]:
    """The config in ``config_file`` (default: the file ``hasten launch`` reads) as a ``ClusterConfig``, or a
    ``SageMakerConfig`` when its ``compute_environment`` is ``AMAZON_SAGEMAKER``.

    A missing file raises ``FileNotFoundError``; unknown keys or bad values raise ``ValueError`` naming them.
    """
    path = os.path.expanduser(os.fspath(config_file)) if config_file is not None else _default_file()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the config file {path} does not exist; create one with `hasten config` "
                                "or pass the path of an existing file")
    sagemaker = str(_read_raw(path).get("compute_environment", "")).upper() == ComputeEnvironment.AMAZON_SAGEMAKER
    return (SageMakerConfig if sagemaker else ClusterConfig).from_yaml_file(path)


def _plain(value: Any) -> Any:
    """Enums as their values and empty sections as absent, as the files store them."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()} or None
    return value


@dataclass
class BaseConfig:
    """The settings every config file has."""

    compute_environment: ComputeEnvironment
    distributed_type: Union[DistributedType, SageMakerDistributedType]
    mixed_precision: str
    use_cpu: bool
    debug: bool

    def __post_init__(self) -> None:
        self.compute_environment = ComputeEnvironment(self.compute_environment)
        kind = SageMakerDistributedType if self.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER \
            else DistributedType
        self.distributed_type = kind("XLA" if self.distributed_type == "TPU" else self.distributed_type)
        if getattr(self, "dynamo_config", None) is None:
            self.dynamo_config = {}

    def to_dict(self) -> dict[str, Any]:
        """The settings as a file stores them: plain values, unset ones left out."""
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_dict(cls, config: dict[str, Any], where: str = "config") -> "BaseConfig":
        """An instance from a file's mapping; keys that are no field of ``cls`` raise ``ValueError``."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - names)
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; remove them (the known keys: {sorted(names)})")
        base = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "mixed_precision": "no",
                "use_cpu": False, "debug": False}
        return cls(**{**base, **config})

    @classmethod
    def from_yaml_file(cls, yaml_file: Optional[str] = None) -> "BaseConfig":
        path = yaml_file if yaml_file is not None else _default_file()
        return cls.from_dict(cls._load(path), f"the config file {path}")

    from_json_file = from_yaml_file

    @classmethod
    def _load(cls, path: str) -> dict[str, Any]:
        return read_config(path)

    def to_yaml_file(self, yaml_file: str) -> None:
        import yaml

        with open(yaml_file, "w", encoding="utf-8") as f:
            yaml.safe_dump(self.to_dict(), f)

    def to_json_file(self, json_file: str) -> None:
        with open(json_file, "w", encoding="utf-8") as f:
            f.write(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


@dataclass
class ClusterConfig(BaseConfig):
    """A config for machines hasten launches on: every key ``hasten launch`` reads, Accelerate's and hasten's."""

    num_processes: int = -1  # -1: not set (the launcher counts the devices)
    machine_rank: int = 0
    num_machines: int = 1
    gpu_ids: Optional[str] = None
    main_process_ip: Optional[str] = None
    main_process_port: Optional[int] = None
    rdzv_backend: Optional[str] = "static"
    same_network: Optional[bool] = TOP["same_network"].default
    main_training_function: str = "main"
    enable_cpu_affinity: bool = False
    fp8_config: Optional[dict] = None
    deepspeed_config: Optional[dict] = None
    fsdp_config: Optional[dict] = None
    parallelism_config: Optional[dict] = None
    megatron_lm_config: Optional[dict] = None
    mpirun_config: Optional[dict] = None
    downcast_bf16: bool = False
    tpu_name: Optional[str] = None
    tpu_zone: Optional[str] = None
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    command_file: Optional[str] = None
    commands: Optional[list] = None
    tpu_vm: Optional[list] = None
    tpu_env: Optional[list] = None
    dynamo_config: Optional[dict] = None
    # hasten's own keys
    gradient_accumulation_steps: int = 1
    num_cpu_threads_per_process: Optional[int] = None
    hang_timeout: float = TOP["hang_timeout"].default

    def __post_init__(self) -> None:
        for section in ("deepspeed_config", "fsdp_config", "megatron_lm_config", "mpirun_config", "fp8_config",
                        "parallelism_config"):
            if getattr(self, section) is None:
                setattr(self, section, {})
        super().__post_init__()

    def to_yaml_file(self, yaml_file: str) -> None:
        """Write the file through the launcher's checks, in the layout ``hasten config`` writes."""
        config = self.to_dict()
        if config.get("num_processes") == -1:
            config.pop("num_processes")
        write_config(yaml_file, config)


@dataclass
class SageMakerConfig(BaseConfig):
    """An Accelerate SageMaker config, read and written as-is (hasten does not launch SageMaker jobs)."""

    ec2_instance_type: str
    iam_role_name: str
    image_uri: Optional[str] = None
    profile: Optional[str] = None
    region: str = "us-east-1"
    num_machines: int = 1
    gpu_ids: str = "all"
    base_job_name: str = "accelerate-sagemaker-1"  # the job name Accelerate's SageMaker configs default to
    pytorch_version: str = SAGEMAKER_PYTORCH_VERSION
    transformers_version: str = SAGEMAKER_TRANSFORMERS_VERSION
    py_version: str = SAGEMAKER_PYTHON_VERSION
    sagemaker_inputs_file: Optional[str] = None
    sagemaker_metrics_file: Optional[str] = None
    additional_args: Optional[dict] = None
    dynamo_config: Optional[dict] = None
    enable_cpu_affinity: bool = False

    @classmethod
    def _load(cls, path: str) -> dict[str, Any]:
        raw = _read_raw(path)
        for key, off in (("distributed_type", "NO"), ("mixed_precision", "no")):
            if raw.get(key) is False:  # YAML 1.1 reads an unquoted NO/no as false
                raw[key] = off
        if "fp16" in raw:  # the old spelling of mixed_precision, as the launcher reads it
            fp16 = raw.pop("fp16")
            raw.setdefault("mixed_precision", "fp16" if fp16 else "no")
        if "dynamo_backend" in raw:
            backend = raw.pop("dynamo_backend")
            raw["dynamo_config"] = {} if str(backend).upper() == "NO" else {"dynamo_backend": backend}
        return raw
