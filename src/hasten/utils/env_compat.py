"""Accelerate's environment and hardware helpers (``str_to_bool``, ``get_int_from_env``, ...).

hasten's own settings readers are in ``hasten.utils.environment`` (``parse_flag`` reads ``HASTEN_*`` then
``ACCELERATE_*``); these keep Accelerate's names and read exactly the variable they are given.
None of them imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
import subprocess
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union

from .environment import PREFIXES, convert_dict_to_env_variables  # noqa: F401 - its home is environment.py (Accelerate's)

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def str_to_bool(value: str, to_bool: bool = False) -> Union[int, bool]:
    """1 (``True`` with ``to_bool``) for y/yes/t/true/on/1, 0 (``False``) for n/no/f/false/off/0, any case."""
    text = value.lower()
    if text in _TRUE:
        return True if to_bool else 1
    if text in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}; use one of {_TRUE + _FALSE}")


def get_int_from_env(env_keys: Any, default: Any) -> Any:
    """The first value >= 0 among the variables ``env_keys`` (in that order), else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Whether the variable ``key`` (``default`` when unset) is a true value in ``str_to_bool``'s sense."""
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """The variable ``key``, or ``default`` when unset."""
    return os.environ.get(key, str(default))


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Those of ``library_names`` that are already imported in this process."""
    return [name for name in library_names if name in sys.modules]


def get_current_device_type() -> tuple[str, str]:
    """(device type, distributed type name) of this machine's accelerator, without initialising it;
    ``("cuda", "MULTI_GPU")`` when there is none, as in Accelerate."""
    from . import imports

    for check, device, kind in ((imports.is_mlu_available, "mlu", "MULTI_MLU"),
                                (imports.is_sdaa_available, "sdaa", "MULTI_SDAA"),
                                (imports.is_musa_available, "musa", "MULTI_MUSA"),
                                (imports.is_npu_available, "npu", "MULTI_NPU"),
                                (imports.is_hpu_available, "hpu", "MULTI_HPU"),
                                (imports.is_neuron_available, "neuron", "MULTI_NEURON"),
                                (imports.is_cuda_available, "cuda", "MULTI_GPU"),
                                (imports.is_xpu_available, "xpu", "MULTI_XPU")):
        if check():
            return device, kind
    return "cuda", "MULTI_GPU"


def _nvidia_smi() -> str:
    return shutil.which("nvidia-smi") or "nvidia-smi"


def get_gpu_info() -> tuple[list[str], int]:
    """(names, count) of the NVIDIA GPUs, read with ``nvidia-smi`` so CUDA is not initialised."""
    output = subprocess.check_output([_nvidia_smi(), "--query-gpu=count,name", "--format=csv,noheader"],
                                     universal_newlines=True).strip()
    rows = output.split(os.linesep)
    return [row.split(",")[1].strip() for row in rows], len(rows)


def get_driver_version() -> str:
    """The NVIDIA driver version, read with ``nvidia-smi``."""
    return subprocess.check_output([_nvidia_smi(), "--query-gpu=driver_version", "--format=csv,noheader"],
                                   universal_newlines=True).strip().split(os.linesep)[0]


def check_cuda_p2p_ib_support() -> bool:
    """False when several RTX 40xx GPUs run a driver older than 550.40.07 (their P2P/IB transfers hang
    NCCL: set ``NCCL_P2P_DISABLE=1`` and ``NCCL_IB_DISABLE=1``); True otherwise, and when unknown."""
    from packaging.version import parse

    try:
        names, count = get_gpu_info()
        if count > 1 and any("RTX 40" in name for name in names):
            return parse(get_driver_version()) >= parse("550.40.07")
    except Exception:  # no nvidia-smi: nothing known against it
        pass
    return True


def check_cuda_fp8_capability() -> bool:
    """Whether the first CUDA GPU computes in fp8 (compute capability 8.9 or newer); False without one."""
    try:
        output = subprocess.check_output([_nvidia_smi(), "--query-gpu=compute_capability", "--format=csv,noheader"],
                                         universal_newlines=True)
        capability = tuple(int(part) for part in output.strip().split(os.linesep)[0].split("."))
    except Exception:
        import torch

        if not torch.cuda.is_available():
            return False
        capability = torch.cuda.get_device_capability()
    return capability >= (8, 9)


@dataclass
class CPUInformation:
    """Where this process sits among CPU processes (from torchrun's or an MPI launcher's variables)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def get_cpu_distributed_information() -> CPUInformation:
    """This process's rank, world size, local rank and local world size from the launcher's variables
    (torchrun, Intel MPI, Open MPI or MVAPICH)."""
    return CPUInformation(
        rank=get_int_from_env(["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"], 0),
        world_size=get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1),
        local_rank=get_int_from_env(["LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                                     "MV2_COMM_WORLD_LOCAL_RANK"], 0),
        local_world_size=get_int_from_env(["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                           "MV2_COMM_WORLD_LOCAL_SIZE"], 1),
    )


def _ours(key: str) -> bool:
    return key.startswith(PREFIXES)


@contextlib.contextmanager
def kept_environment() -> Iterator[None]:
    """Put the ``HASTEN_*``/``ACCELERATE_*`` variables back as they were on entry when the block ends:
    those set inside are removed, those changed or removed get their old values back."""
    before = {k: v for k, v in os.environ.items() if _ours(k)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if _ours(k) and k not in before]:
            del os.environ[key]
        os.environ.update(before)


# The wrappers purge_accelerate_environment made, so that a method inherited from a decorated base
# is not wrapped twice (a weak set: it does not keep classes alive).
_PURGING = weakref.WeakSet()


def _purging(func: Callable) -> Callable:
    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        with kept_environment():
            return func(*args, **kwargs)

    _PURGING.add(run)
    return run


def _wrap_test_methods(cls: type) -> None:
    """Wrap every ``test*`` function ``cls`` has, its own and inherited, that is not wrapped yet."""
    for name in dir(cls):
        if name.startswith("test"):
            method = inspect.getattr_static(cls, name)
            if inspect.isfunction(method) and method not in _PURGING:
                setattr(cls, name, _purging(method))


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Decorator: the ``HASTEN_*``/``ACCELERATE_*`` variables a function (or each ``test*`` method of a
    class) sets or changes are put back as they were when it returns, so one test cannot leak settings
    into the next. On a class it covers the inherited test methods and those of every subclass too."""
    if not isinstance(func_or_cls, type):
        return _purging(func_or_cls)
    _wrap_test_methods(func_or_cls)
    # Subclasses are defined after the decorator ran: wrap their test methods as they are created,
    # after whatever the class's own __init_subclass__ does.
    previous = inspect.getattr_static(func_or_cls, "__init_subclass__")  # the class's own, or inherited

    def __init_subclass__(subclass: type, **kwargs: Any) -> None:
        previous.__get__(None, subclass)(**kwargs)
        _wrap_test_methods(subclass)

    func_or_cls.__init_subclass__ = classmethod(__init_subclass__)
    return func_or_cls


# The name a suite gets when it replaces the word accelerate by hasten (as the migration guide says).
purge_hasten_environment = purge_accelerate_environment


def _requires(check: Callable[[], bool], package: str, decorated: Callable) -> Callable:
    @functools.wraps(decorated)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not check():
            raise ImportError(f"{decorated.__name__} needs {package}; install it (pip install {package})")
        return decorated(*args, **kwargs)

    return run


def deepspeed_required(func: Callable) -> Callable:
    """Decorator: calling ``func`` without DeepSpeed installed raises an ImportError saying so."""
    from .imports import is_deepspeed_available

    return _requires(is_deepspeed_available, "deepspeed", func)


def torchao_required(func: Callable) -> Callable:
    """Decorator: calling ``func`` without torchao installed raises an ImportError saying so."""
    from .imports import is_torchao_available

    return _requires(is_torchao_available, "torchao", func)


def is_habana_gaudi1() -> bool:
    """Whether this machine's Habana device is a first-generation Gaudi (False without one)."""
    from .imports import is_hpu_available

    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as hthpu  # noqa: PLC0415 - only on Gaudi machines

    return hthpu._get_device_type() == hthpu.synDeviceType.synDeviceGaudi
