"""Host copies of a checkpoint's tensors for ``save_state(blocking=False)``, reused from save to save.

A background save must snapshot the state before it returns (training goes on and changes the
parameters in place), and it should return fast. Four things make the copy fast and its memory
bounded:

* one host allocation (an *arena*) per *part* of the checkpoint (a file of a full-state save: a
  model, an optimizer, a registered object, the process's own state; a top-level entry of a sharded
  save's state), allocated on the first save and reused by every later save, so a save copies into
  memory touched before (fresh pages cost a page fault each, several times the copy itself). A
  layout change (names, shapes, dtypes, devices) in one part re-makes that part only, and only when
  it no longer fits: every arena is whole pages, a part that outgrew its arena gets 1/8 more room
  (a registered object that grows a little at every save is re-made rarely), one that shrank below
  half of it is re-made smaller;
* for CUDA tensors an arena is page-locked (registered with the CUDA driver, as PyTorch's DCP
  stager does, rather than taken from the caching host allocator, which rounds every block up to a
  power of two), so the device-to-host copies run asynchronously at PCIe speed, all queued at once
  (every part) and followed by ONE synchronisation of the streams that ran them;
* the arenas of a save still being written are never overwritten or freed: staging (and
  ``release``) first waits for the writer thread that reads them;
* ``ProjectConfiguration(staging_memory_limit=...)`` caps the bytes kept between saves. Parts are
  kept in checkpoint order while they fit; a part past the limit is copied into pageable memory
  made for that save alone and freed once it is written (correct, but slower: fresh pages every
  save, and CUDA tensors copied synchronously), and a warning says so once. ``release`` (called by
  ``Accelerator.free_memory``) unpins and drops every arena.

CPU tensors are copied too (the snapshot must not change under the writer), into pageable memory:
nothing asks for pinned memory on a machine without CUDA, where that would fail. The limit counts
these host bytes as well.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Iterable, Optional

import torch

from ..warning_kinds import HastenWarning

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


def _layout_bytes(layout: tuple) -> int:
    return sum(_round_up(_numel(shape) * dtype.itemsize, _ALIGN) for _, shape, dtype, _ in layout)


def _is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (torch's public class; never guessed from a private attribute)."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before it is imported
    return module is not None and isinstance(value, module.DTensor)


class Arena:
    """One page-aligned host allocation of ``nbytes`` (whole pages), with a view for each tensor of
    a layout that fits in it (``relayout`` changes the layout without allocating)."""

    def __init__(self, layout: tuple, pinned: bool, capacity: int = 0) -> None:
        self.nbytes = _round_up(max(capacity, _layout_bytes(layout)), _PAGE)
        self.wants_pinned = pinned  # as asked: a failed page-locking is not retried at every save
        self.pinned = False
        self._finalizer: Optional[weakref.finalize] = None
        # Page-aligned, whole pages: a registered range never shares a page with another allocation.
        raw = torch.empty(self.nbytes + _PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % _PAGE
        self.flat = raw[skip:skip + self.nbytes]
        if pinned and self.nbytes:
            self.pinned = self._pin(self.flat)
        self.layout: tuple = ()
        self.views: dict[Any, torch.Tensor] = {}
        self.relayout(layout)

    def holds(self, layout: tuple, pinned: bool) -> bool:
        """Whether ``layout`` can reuse this arena: it fits, it does not waste more than half of it,
        and it wants the same kind of memory."""
        need = _layout_bytes(layout)
        return pinned == self.wants_pinned and need <= self.nbytes <= max(2 * _round_up(need, _PAGE), _PAGE)

    def relayout(self, layout: tuple) -> None:
        """Views for ``layout`` (which ``holds`` accepted) over the same memory."""
        if layout == self.layout:
            return
        views, offset = {}, 0
        for key, shape, dtype, _ in layout:
            nbytes = _numel(shape) * dtype.itemsize
            views[key] = self.flat[offset:offset + nbytes].view(dtype).view(shape)
            offset += _round_up(nbytes, _ALIGN)
        self.layout, self.views = layout, views

    def _pin(self, flat: torch.Tensor) -> bool:
        # Touched first by a parallel fill: registering faults every page in, one thread at a time.
        flat.zero_()
        error = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 1))  # 1: portable
        if error != 0:
            warnings.warn(f"save_state(blocking=False): page-locking {flat.numel() / 2**30:.1f} GiB of staging memory "
                          f"failed (CUDA error {error}); staging into pageable memory, which copies from the GPU "
                          "more slowly", HastenWarning, stacklevel=6)
            return False
        self._finalizer = weakref.finalize(self, _unpin, flat, flat.data_ptr())
        self._finalizer.atexit = False  # never call into CUDA while the interpreter shuts down
        return True

    def release(self) -> None:
        """Unregister the memory now (it is freed once nothing refers to the arena or its views)."""
        if self._finalizer is not None:
            self._finalizer()


def _numel(shape: tuple) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


class Stager:
    """Copies of a checkpoint's tensors in host memory, reused from one save to the next.

    ``stage`` handles the per-file tensors of a full-state save (a part per file), ``stage_tree``
    the nested states (DTensor shards included) of a sharded save (a part per top-level entry).
    ``limit``: the bytes the kept arenas may hold (None: no limit); the caller sets it from
    ``ProjectConfiguration.staging_memory_limit`` before each save.
    """

    def __init__(self) -> None:
        self._arenas: dict[tuple[str, str], Arena] = {}  # (slot, part) -> the arena kept for it
        self.reader: Optional[threading.Thread] = None  # the writer thread of the last staged save
        self.limit: Optional[int] = None
        self._told_limit = False

    @property
    def kept_bytes(self) -> int:
        """Host bytes held between saves (what ``limit`` caps)."""
        return sum(arena.nbytes for arena in self._arenas.values())

    # Names kept for callers and checks that look at the buffers (the kept ones).
    @property
    def buffers(self) -> dict[Any, torch.Tensor]:
        return self._views("items")

    @property
    def tree_buffers(self) -> dict[Any, torch.Tensor]:
        return self._views("tree")

    def _views(self, slot: str) -> dict[Any, torch.Tensor]:
        return {key: view for (kind, _), arena in self._arenas.items() if kind == slot for key, view in arena.views.items()}

    def _wait_for_reader(self) -> None:
        if self.reader is not None:  # its writer may still read the buffers we are about to overwrite
            self.reader.join()
            self.reader = None

    def release(self) -> None:
        """Unpin and drop every kept arena, once the writer reading them is done."""
        self._wait_for_reader()
        arenas, self._arenas = self._arenas, {}
        for arena in arenas.values():
            arena.release()

    def _arena_for(self, slot: str, part: str, layout: tuple, room: Optional[int]) -> tuple[Arena, bool]:
        """The arena ``part`` is copied into, and whether it is kept (False: made for this save only,
        past the limit). ``room``: the bytes it may keep (None: any)."""
        pinned = wants_pinned(device for *_, device in layout)
        name = (slot, part)
        arena = self._arenas.get(name)
        if arena is not None and arena.holds(layout, pinned) and (room is None or arena.nbytes <= room):
            arena.relayout(layout)
            return arena, True
        outgrown = arena is not None and _layout_bytes(layout) > arena.nbytes
        if arena is not None:  # freed before its replacement is allocated
            self._arenas.pop(name).release()
        del arena
        need = _round_up(_layout_bytes(layout), _PAGE)
        capacity = _round_up(need + need // 8, _PAGE) if outgrown else need  # a growing part grows again
        if room is not None and capacity > room:
            capacity = need
        if room is not None and capacity > room:
            return Arena(layout, pinned=False), False
        self._arenas[name] = Arena(layout, pinned, capacity)
        return self._arenas[name], True

    def _copy_all(self, slot: str, parts: dict[str, list[tuple[Any, torch.Tensor]]]) -> dict[Any, torch.Tensor]:
        """Copy each part's ``(key, tensor)`` pairs into its arena; returns the views by key."""
        self._wait_for_reader()
        for name in [n for n in self._arenas if n[0] == slot and n[1] not in parts]:  # parts this save lacks
            self._arenas.pop(name).release()
        room = None if self.limit is None else self.limit - sum(a.nbytes for n, a in self._arenas.items() if n[0] != slot)
        views: dict[Any, torch.Tensor] = {}
        devices, spilled = set(), 0
        for part, pairs in parts.items():
            tensors = [(key, t.detach()) for key, t in pairs]
            layout = tuple((key, tuple(t.shape), t.dtype, t.device.type) for key, t in tensors)
            arena, kept = self._arena_for(slot, part, layout, room)
            if room is not None:
                room -= arena.nbytes if kept else 0
            spilled += 0 if kept else arena.nbytes
            for key, tensor in tensors:
                on_cuda = tensor.device.type == "cuda"
                arena.views[key].copy_(tensor, non_blocking=on_cuda and arena.pinned)
                if on_cuda:
                    devices.add(tensor.device)
            views.update(arena.views)
        for device in devices:  # the one wait: every copy was queued on that device's current stream
            torch.cuda.current_stream(device).synchronize()
        if spilled and not self._told_limit:
            self._told_limit = True
            warnings.warn(
                f"save_state(blocking=False): ProjectConfiguration(staging_memory_limit={self.limit}) bytes cannot hold "
                f"this save's staging buffers; {spilled} bytes are staged into pageable memory made for each save and "
                "freed once it is written (slower: fresh pages at every save, CUDA tensors copied synchronously). "
                "Raise the limit (or HASTEN_STAGING_MEMORY_LIMIT) to keep them between saves. Said once.",
                HastenWarning, stacklevel=4)
        return views

    def stage(self, items: list) -> list:
        """``items`` with their tensors replaced by staged copies (byte items are copies already)."""
        parts = {item.name: [((item.name, key), tensor) for key, tensor in item.tensors.items()]
                 for item in items if item.tensors is not None}
        views = self._copy_all("items", parts)
        return [item if item.tensors is None else
                item._replace(tensors={key: views[(item.name, key)] for key in item.tensors}) for item in items]

    def stage_tree(self, tree: Any) -> Any:
        """A copy of a nested state (dicts, lists, tensors, DTensors; other values as they are) whose
        tensors live in the staging arenas (one per top-level entry). A DTensor stays a DTensor with
        the same placement over the same mesh: each process copies its own shard (a sharded
        checkpoint's state)."""
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {}

        def collect(value: Any, path: str) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    collect(v, f"{path}/{k}")
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    collect(v, f"{path}/{i}")
            elif isinstance(value, torch.Tensor):
                local = value.detach().to_local() if _is_dtensor(value) else value
                parts.setdefault(path.split("/")[1] if path else "", []).append((path, local))

        collect(tree, "")
        views = self._copy_all("tree", parts)

        def rebuild(value: Any, path: str) -> Any:
            if isinstance(value, dict):
                return {k: rebuild(v, f"{path}/{k}") for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(rebuild(v, f"{path}/{i}") for i, v in enumerate(value))
            if not isinstance(value, torch.Tensor):
                return value
            if not _is_dtensor(value):
                return views[path]
            from torch.distributed.tensor import DTensor

            # Built from the spec, not DTensor.from_local: that would move a host copy back to the GPU. The spec
            # is DTensor's private one: a torch without it is an error here, never a plain tensor instead.
            spec = getattr(value, "_spec", None)
            if spec is None:
                raise RuntimeError(f"staging a sharded checkpoint needs torch's DTensor._spec (its layout record), and "
                                   f"torch {torch.__version__} has none; save with blocking=True")
            return DTensor(views[path], spec, requires_grad=False)

        return rebuild(tree, "")
