"""The few collectives that saving, loading and resuming share.

They live below ``mixin`` (the Accelerator's methods), ``commit``, ``loading`` and ``resume`` so that
each of those imports them downward instead of from one another.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class ProcessGroupGone(RuntimeError):
    """A save that needs every process found the process group destroyed; nothing was committed."""


def _several_processes() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(value: Any, group: Any = None, world_size: int = 0) -> list:
    """Every process's ``value`` (a list of one value without a process group).

    ``world_size``: how many processes must take part; a save started on several processes whose
    process group is gone by now must not go on as if it were alone (it would commit its own files
    only).
    """
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupGone(
            f"the process group was destroyed while a save of {world_size} processes still needed it; nothing "
            "was committed. Wait for the save before tearing the group down: accelerator.wait_for_checkpoint() "
            "or accelerator.end_training() before torch.distributed.destroy_process_group()"
        )
    if _several_processes():
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, value, group=group)
        return out
    return [value]


def broadcast_from_main(values: list) -> list:
    """``values`` as process 0 holds them, on every process (in place; returned for convenience)."""
    if _several_processes():
        dist.broadcast_object_list(values, src=0)
    return values
