"""The suite's device policy, in one place: where one process runs and where N processes run.

- One process runs where a plain ``Accelerator()`` puts it: CUDA when the machine has a GPU.
- N processes on one machine each take their own GPU (``cuda:LOCAL_RANK``, NCCL) when the machine
  shows at least N GPUs; otherwise all of them run on CPU (gloo). They are told so the way
  ``hasten launch --cpu`` tells its processes: ``HASTEN_USE_CPU=1`` (no test-only back door).

Tests build their reference tensors and models on ``reference_device()`` (or ``acc.device``), never on
an implicit CPU, so that a check means the same thing on a CPU-only machine and on a GPU machine.
"""

from __future__ import annotations

from typing import Optional


def gpu_count() -> int:
    """CUDA devices this process may use (``CUDA_VISIBLE_DEVICES`` respected).

    ``torch.cuda.device_count`` asks NVML first, so it does not initialise CUDA in the test process
    (a forking launcher started later from the same process would be refused otherwise).
    """
    import torch

    return torch.cuda.device_count()


def ranks_get_own_gpu(processes: int, gpus: Optional[int] = None) -> bool:
    """Whether ``processes`` ranks on this machine can each have a GPU of their own (never when the
    suite itself runs under ``HASTEN_USE_CPU=1``: then everything runs on CPU)."""
    if gpus is None:
        from hasten.utils.environment import parse_flag

        gpus = 0 if parse_flag("USE_CPU") else gpu_count()
    return gpus > 0 and gpus >= processes


def process_env(processes: int, gpus: Optional[int] = None) -> dict[str, str]:
    """Environment for ``processes`` ranks started directly (torchrun's variables set by the test).

    Empty when each rank gets its own GPU; else the ``--cpu`` contract, so the ranks use gloo on CPU
    instead of several of them asking for the same GPU.
    """
    return {} if ranks_get_own_gpu(processes, gpus) else {"HASTEN_USE_CPU": "1"}


def launch_flags(processes: int, gpus: Optional[int] = None) -> list[str]:
    """``hasten launch`` flags for ``processes`` processes on one machine: ``--cpu`` unless each gets a GPU."""
    return [] if ranks_get_own_gpu(processes, gpus) else ["--cpu"]


def reference_device():
    """The device this process's tensors live on: the process state's device if one exists, else the
    device a new one-process ``Accelerator()`` would pick (CUDA on a GPU machine). Build references here."""
    from hasten.device_choice import pick_device
    from hasten.state import PartialState
    from hasten.topology import detect_topology
    from hasten.utils.environment import parse_flag

    state = PartialState._shared_state
    if state.get("device") is not None:
        return state["device"]
    return pick_device(detect_topology(), parse_flag("USE_CPU"))


def expected_device(local_rank: int):
    """Where the policy above puts a rank (stated independently of hasten's own choice, to check it)."""
    import torch

    from hasten.utils.environment import parse_flag

    if parse_flag("USE_CPU") or gpu_count() == 0:
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def multi_process_type(processes: int) -> str:
    """The ``distributed_type`` that ``processes`` ranks started under this policy report."""
    return "MULTI_GPU" if ranks_get_own_gpu(processes) else "MULTI_CPU"
