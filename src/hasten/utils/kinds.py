"""Accelerate's remaining small enums, with its member names and values."""

from __future__ import annotations

import enum


class ComputeEnvironment(str, enum.Enum):
    """Where a config file says the job runs (hasten launches on local machines only)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(str, enum.Enum):
    """SageMaker's own distribution modes (named for config files; hasten does not launch on SageMaker)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class CustomDtype(enum.Enum):
    """Element types torch has no dtype for, as device-map size estimates name them."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"
