"""Freeing accelerator memory, and retrying a function with smaller batches on out-of-memory."""

from __future__ import annotations

import functools
import gc
import inspect
from typing import Any, Callable, Optional

import torch

# Texts of out-of-memory errors that torch raises as plain RuntimeErrors.
_OOM_TEXTS = (
    " out of memory",  # CUDA, ROCm, XPU
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "can't allocate memory",  # CPU, other allocators
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN failing on a too-large batch
    "PT_DEVMEM Allocation failed",  # HPU
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Give cached accelerator memory back to the device (and run ``gc.collect()`` when asked; slow)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # a no-op while CUDA is not initialised: does not start it
    for name in ("xpu", "npu", "mlu", "musa"):
        module = getattr(torch, name, None)
        if module is not None and getattr(module, "is_available", lambda: False)() and hasattr(module, "empty_cache"):
            module.empty_cache()
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drop references to ``objects`` and free the accelerator cache; returns one None per object.

    Reassign the result to the same names, e.g. ``model, optimizer = release_memory(model, optimizer)``.
    """
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    clear_device_cache(garbage_collection=True)
    return objects


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` means "out of memory" (so a smaller batch may fit)."""
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    if oom_types and isinstance(exception, oom_types):
        return True
    if isinstance(exception, RuntimeError) and exception.args and isinstance(exception.args[0], str):
        return any(text in exception.args[0] for text in _OOM_TEXTS)
    return False


def find_executable_batch_size(function: Optional[Callable] = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Optional[Callable[[], int]] = None) -> Callable:
    """Decorator: call ``function(batch_size, *args, **kwargs)``, shrinking the batch size on out-of-memory.

    The decorated function takes the batch size as its first argument, and is called without it:

        @find_executable_batch_size(starting_batch_size=128)
        def train(batch_size, model, optimizer): ...

        train(model, optimizer)

    On an out-of-memory error (``torch.OutOfMemoryError``, or CUDA/XPU/MPS/CPU allocator errors)
    memory is freed and the call is retried with ``int(batch_size * 0.9)`` (Accelerate's rule, so a
    migrated script trains with the same batch size), or with what ``reduce_batch_size_fn()``
    returns. The size that worked is kept for later calls. Other exceptions propagate unchanged.
    Reaching a batch size of 0 raises ``RuntimeError``.
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    # 0 is accepted here and fails at the call, as a batch size shrunk to 0 does (Accelerate's
    # RuntimeError); a negative or non-integer size is a mistake caught right away.
    if not isinstance(starting_batch_size, int) or starting_batch_size < 0:
        raise ValueError(f"starting_batch_size={starting_batch_size!r} must be a positive integer")
    batch_size = starting_batch_size

    def by_a_tenth() -> int:
        return int(batch_size * 0.9)

    shrink = reduce_batch_size_fn or by_a_tenth
    signature = inspect.signature(function)
    first = next(iter(signature.parameters), None)
    name = getattr(function, "__name__", "the function")

    def _check_call(args: tuple, kwargs: dict) -> None:
        passed_twice = first is not None and first in kwargs
        try:
            signature.bind(batch_size, *args, **kwargs)
            too_many = False
        except TypeError as err:
            too_many = "too many positional" in str(err) or "multiple values" in str(err)
        if passed_twice or too_many:
            raise TypeError(
                f"{name}() was called with its batch size (or with too many arguments): find_executable_batch_size "
                f"passes the batch size as the first argument itself; call {name}() with the other arguments only, "
                f"and set the first size to try with find_executable_batch_size(starting_batch_size=...)"
            )

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        _check_call(args, kwargs)
        clear_device_cache(garbage_collection=True)
        while True:
            if starting_batch_size == 0:
                raise RuntimeError(f"find_executable_batch_size: no executable batch size found for {name}(), "
                                   "reached zero: starting_batch_size=0; start from a positive batch size")
            if batch_size <= 0:
                raise RuntimeError(
                    f"find_executable_batch_size: {name}() ran out of memory at every batch size down to 1 "
                    f"(started at {starting_batch_size}); reduce the model or sequence size, or use gradient "
                    "accumulation / a memory-saving strategy"
                )
            out_of_memory = False
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - anything but OOM is re-raised untouched
                if not should_reduce_batch_size(err):
                    raise
                out_of_memory = True
            if out_of_memory:
                # Outside the except block: the exception's traceback (and the tensors its frames
                # hold) is gone, so the memory can really be freed.
                clear_device_cache(garbage_collection=True)
                new_size = shrink()
                if not isinstance(new_size, int):
                    raise TypeError(f"reduce_batch_size_fn returned {new_size!r}; it must return an int")
                batch_size = new_size

    return wrapper
