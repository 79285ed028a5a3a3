"""Checks of hasten's collective operations (``hasten.utils``) on the processes it is started on.

    hasten launch --num_processes 2 --cpu path/to/test_ops.py
    debug_launcher(test_ops.main)                 # from hasten.test_utils import test_ops

Each check raises AssertionError naming what differed. Process ``i`` of ``N`` holds the values
``i*N+1 .. i*N+N``, so every result can be computed by hand.
"""

from __future__ import annotations

import torch

from hasten import PartialState
from hasten.test_utils.testing import assert_exception
from hasten.utils.operations import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    copy_tensor_to_devices,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)


def values(state: PartialState) -> torch.Tensor:
    """This process's N values: ``i*N+1 .. i*N+N`` as floats on its device."""
    n = state.num_processes
    return (torch.arange(n, dtype=torch.float32) + state.process_index * n + 1).to(state.device)


def check_gather(state: PartialState) -> None:
    got = gather(values(state))
    assert got.tolist() == list(range(1, state.num_processes ** 2 + 1)), got


def check_gather_object(state: PartialState) -> None:
    got = gather_object([state.process_index])
    assert got == list(range(state.num_processes)), got


def check_gather_non_contiguous(state: PartialState) -> None:
    tensor = torch.arange(12, dtype=torch.float32, device=state.device).view(4, 3).t()
    assert not tensor.is_contiguous()
    got = gather(tensor)
    assert got.shape == (3 * state.num_processes, 4), got.shape
    assert torch.equal(got[:3], tensor), got


def check_broadcast(state: PartialState) -> None:
    got = broadcast(values(state), from_process=0)
    assert got.tolist() == list(range(1, state.num_processes + 1)), got
    objects = [state.process_index, "x"]
    broadcast_object_list(objects, from_process=state.num_processes - 1)
    assert objects == [state.num_processes - 1, "x"], objects


def check_pad_across_processes(state: PartialState) -> None:
    # Process i holds i+1 values; every one is padded to the longest, N.
    mine = torch.arange(state.process_index + 1, dtype=torch.float32, device=state.device)
    padded = pad_across_processes(mine)
    assert padded.shape == (state.num_processes,), padded.shape
    assert padded.tolist() == list(range(state.process_index + 1)) + [0] * (state.num_processes - state.process_index - 1)
    first = pad_across_processes(mine, pad_first=True, pad_index=-1)
    assert first.tolist()[-(state.process_index + 1):] == mine.tolist(), first


def check_reduce(state: PartialState) -> None:
    n = state.num_processes
    by_column = torch.stack([values(state).new_tensor([i * n + c + 1 for c in range(n)]) for i in range(n)])
    summed = reduce(values(state), "sum")
    assert torch.allclose(summed, by_column.sum(0)), summed
    mean = reduce(values(state), "mean")
    assert torch.allclose(mean, by_column.mean(0)), mean


def check_copy_tensor_to_devices(state: PartialState) -> None:
    mine = torch.tensor([1, 2, 3], dtype=torch.int, device=state.device) if state.is_main_process else None
    got = copy_tensor_to_devices(mine)
    assert got.tolist() == [1, 2, 3], got


def check_debug_mode(state: PartialState) -> None:
    """In debug mode, mismatched inputs raise on every process instead of hanging."""
    if not (state.debug and state.num_processes > 1):
        return
    odd = torch.zeros(state.process_index + 1, device=state.device)
    with assert_exception(DistributedOperationException):
        gather(odd)
    with assert_exception(DistributedOperationException):
        broadcast(odd)


def main() -> None:
    state = PartialState()
    checks = [check_gather, check_gather_object, check_gather_non_contiguous, check_broadcast,
              check_pad_across_processes, check_reduce, check_copy_tensor_to_devices, check_debug_mode]
    for check in checks:
        check(state)
        state.wait_for_everyone()
        state.print(f"{check.__name__}: ok on {state.num_processes} process(es)"
                    f"{' (debug mode)' if state.debug else ''}")


if __name__ == "__main__":
    main()
