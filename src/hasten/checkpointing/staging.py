"""Host copies of a checkpoint's tensors for ``save_state(blocking=False)``, reused from save to save.

A background save must snapshot the state before it returns (training goes on and changes the
parameters in place), and it should return fast. Three things make the copy fast:

* one flat host buffer per *layout* (the names, shapes, dtypes and devices of the staged tensors),
  allocated on the first save and reused by every later save with the same layout, so a save copies
  into memory touched before (fresh pages cost a page fault each, several times the copy itself)
  and a layout change (a new optimizer state after the first step) reallocates once;
* for CUDA tensors the buffer is page-locked (registered with the CUDA driver, as PyTorch's DCP
  stager does, rather than taken from the caching host allocator, which rounds every block up to a
  power of two), so the device-to-host copies run asynchronously at PCIe speed, all queued at once
  and followed by ONE synchronisation of the streams that ran them;
* the buffer of a save still being written is never overwritten: staging first waits for the
  writer thread that reads it.

CPU tensors are copied too (the snapshot must not change under the writer), into pageable memory:
nothing asks for pinned memory on a machine without CUDA, where that would fail.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Iterable, Optional

import torch

_ALIGN = 64  # every view starts on a cache line (more than any dtype's alignment)
_PAGE = 4096


def wants_pinned(device_types: Iterable[str], cuda_available: Optional[bool] = None) -> bool:
    """Whether a staging buffer should be page-locked: only when it receives CUDA tensors, and only
    where CUDA works (asking for pinned memory without it raises)."""
    if "cuda" not in set(device_types):
        return False
    return torch.cuda.is_available() if cuda_available is None else bool(cuda_available)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _unpin(flat: torch.Tensor, start: int) -> None:
    """Unregister ``flat``'s memory; holding ``flat`` until then keeps it from being freed first."""
    torch.cuda.cudart().cudaHostUnregister(start)


class Arena:
    """One host allocation holding a view for each tensor of a layout."""

    def __init__(self, layout: tuple, pinned: bool) -> None:
        self.layout = layout
        offsets, total = [], 0
        for _, shape, dtype, _ in layout:
            offsets.append(total)
            total += _round_up(_numel(shape) * dtype.itemsize, _ALIGN)
        self.nbytes = total
        self.pinned = False
        self._finalizer: Optional[weakref.finalize] = None
        # Page-aligned, whole pages: a registered range never shares a page with another allocation.
        raw = torch.empty(_round_up(total, _PAGE) + _PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % _PAGE
        flat = raw[skip:skip + _round_up(total, _PAGE)]
        if pinned and flat.numel():
            self.pinned = self._pin(flat)
        self.views: dict[Any, torch.Tensor] = {}
        for (key, shape, dtype, _), offset in zip(layout, offsets):
            nbytes = _numel(shape) * dtype.itemsize
            self.views[key] = flat[offset:offset + nbytes].view(dtype).view(shape)

    def _pin(self, flat: torch.Tensor) -> bool:
        # Touched first by a parallel fill: registering faults every page in, one thread at a time.
        flat.zero_()
        error = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 1))  # 1: portable
        if error != 0:
            warnings.warn(f"save_state(blocking=False): page-locking {flat.numel() / 2**30:.1f} GiB of staging memory "
                          f"failed (CUDA error {error}); staging into pageable memory, which copies from the GPU "
                          "more slowly", stacklevel=5)
            return False
        self._finalizer = weakref.finalize(self, _unpin, flat, flat.data_ptr())
        self._finalizer.atexit = False  # never call into CUDA while the interpreter shuts down
        return True

    def release(self) -> None:
        """Unregister the memory now (it is freed once no staged tensor refers to it)."""
        if self._finalizer is not None:
            self._finalizer()


def _numel(shape: tuple) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


class Stager:
    """Copies of a checkpoint's tensors in host memory, reused from one save to the next.

    ``stage`` handles the per-file tensors of a full-state save, ``stage_tree`` the nested states
    (DTensor shards included) of a sharded save; each keeps its own arena.
    """

    def __init__(self) -> None:
        self._arenas: dict[str, Arena] = {}
        self.reader: Optional[threading.Thread] = None  # the writer thread of the last staged save

    # Names kept for callers and checks that look at the buffers.
    @property
    def buffers(self) -> dict[Any, torch.Tensor]:
        arena = self._arenas.get("items")
        return dict(arena.views) if arena is not None else {}

    @property
    def tree_buffers(self) -> dict[Any, torch.Tensor]:
        arena = self._arenas.get("tree")
        return dict(arena.views) if arena is not None else {}

    def _copy_all(self, slot: str, pairs: list[tuple[Any, torch.Tensor]]) -> dict[Any, torch.Tensor]:
        """Copy each ``(key, tensor)`` into the arena of ``slot`` (a new one when the layout changed)."""
        if self.reader is not None:  # its writer may still read the buffers we are about to overwrite
            self.reader.join()
            self.reader = None
        tensors = [(key, t.detach()) for key, t in pairs]
        layout = tuple((key, tuple(t.shape), t.dtype, t.device.type) for key, t in tensors)
        arena = self._arenas.get(slot)
        if arena is None or arena.layout != layout:
            if arena is not None:
                arena.release()
            del arena
            self._arenas.pop(slot, None)
            arena = self._arenas[slot] = Arena(layout, wants_pinned(t.device.type for _, t in tensors))
        devices = set()
        for key, tensor in tensors:
            on_cuda = tensor.device.type == "cuda"
            arena.views[key].copy_(tensor, non_blocking=on_cuda and arena.pinned)
            if on_cuda:
                devices.add(tensor.device)
        for device in devices:  # the one wait: every copy was queued on that device's current stream
            torch.cuda.current_stream(device).synchronize()
        return arena.views

    def stage(self, items: list) -> list:
        """``items`` with their tensors replaced by staged copies (byte items are copies already)."""
        pairs = [((item.name, key), tensor) for item in items if item.tensors is not None
                 for key, tensor in item.tensors.items()]
        views = self._copy_all("items", pairs)
        return [item if item.tensors is None else
                item._replace(tensors={key: views[(item.name, key)] for key in item.tensors}) for item in items]

    def stage_tree(self, tree: Any) -> Any:
        """A copy of a nested state (dicts, lists, tensors, DTensors; other values as they are) whose
        tensors live in the staging arena. A DTensor stays a DTensor with the same placement over the
        same mesh: each process copies its own shard (a sharded checkpoint's state)."""
        pairs: list[tuple[str, torch.Tensor]] = []

        def collect(value: Any, path: str) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    collect(v, f"{path}/{k}")
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    collect(v, f"{path}/{i}")
            elif isinstance(value, torch.Tensor):
                local = value.detach().to_local() if getattr(value, "_spec", None) is not None else value
                pairs.append((path, local))

        collect(tree, "")
        views = self._copy_all("tree", pairs)

        def rebuild(value: Any, path: str) -> Any:
            if isinstance(value, dict):
                return {k: rebuild(v, f"{path}/{k}") for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(rebuild(v, f"{path}/{i}") for i, v in enumerate(value))
            if not isinstance(value, torch.Tensor):
                return value
            spec = getattr(value, "_spec", None)
            if spec is None:
                return views[path]
            from torch.distributed.tensor import DTensor

            # Built from the spec, not DTensor.from_local: that would move a host copy back to the GPU.
            return DTensor(views[path], spec, requires_grad=False)

        return rebuild(tree, "")
