"""Checks of process state and topology, run inside each rank (see distributed.py)."""

import os

import torch

from hasten.state import PartialState

from devices import expected_device


def check_identity():
    s = PartialState()
    assert s.num_processes in (1, 2)
    assert s.is_main_process == (s.process_index == 0)
    assert s.is_last_process == (s.process_index == s.num_processes - 1)
    assert s.device == expected_device(s.local_process_index), s.device
    return {"rank": s.process_index, "world": s.num_processes, "type": str(s.distributed_type), "backend": s.backend,
            "use_cpu": os.environ.get("HASTEN_USE_CPU")}


def check_split_between_processes():
    s = PartialState()
    with s.split_between_processes(list(range(5))) as part:
        got = part
    with s.split_between_processes(list(range(5)), apply_padding=True) as part:
        padded = part
    with s.split_between_processes({"a": [1, 2, 3], "b": ["x", "y", "z"]}) as part:
        d = part
    with s.split_between_processes(torch.arange(3), apply_padding=True) as part:
        t = part.tolist()
    return {"plain": got, "padded": padded, "dict": d, "tensor": t}


def check_main_process_first():
    import os
    import time

    s = PartialState()
    path = os.path.join(os.environ["HASTEN_TEST_TMP"], "order.txt")
    with s.main_process_first():
        if not s.is_main_process:
            time.sleep(0)  # the main process has finished its block already
        with open(path, "a") as f:
            f.write(f"{s.process_index}\n")
    s.wait_for_everyone()
    with open(path) as f:
        order = [int(x) for x in f.read().split()]
    assert order[0] == 0, order
    return order
