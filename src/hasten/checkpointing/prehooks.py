"""The ``save_state`` / ``load_state`` pre-hooks an Accelerator holds.

``mixin`` registers them (``register_*_state_pre_hook``) into the Accelerator's
``CheckpointSession``; ``mixin`` runs the save hooks and ``loading`` / ``accelerate_folder`` run the
load hooks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

from . import commit


class PreHooks:
    """Hooks called in registration order; ``register`` returns a handle that removes one."""

    def __init__(self) -> None:
        # An OrderedDict: torch's RemovableHandle keeps a weak reference to it (plain dicts have none).
        self.hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()

    def register(self, hook: Callable[..., None]) -> Any:
        """Add ``hook``; returns a handle whose ``remove()`` unregisters it."""
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(self.hooks)
        self.hooks[handle.id] = hook
        return handle

    def run(self, models: list, *args: Any) -> None:
        """Call every hook with ``(models, *args)`` (over a copy of the hooks: a hook may remove itself).

        ``models`` is the caller's list, which the hooks may shorten (a model they saved or loaded
        themselves); before the first hook each DistributedDataParallel in it is replaced by the module
        it wraps (``hook_view``)."""
        if self.hooks:
            hook_view(models)
        for hook in list(self.hooks.values()):
            hook(models, *args)


def hook_view(models: list) -> None:
    """Replace, in place, each DistributedDataParallel in ``models`` by the module it wraps.

    Accelerate's registry keeps the module ``prepare`` was given and wraps it for DDP apart, so its
    save and load pre-hooks see the user's module: diffusers' hooks call ``model.save_pretrained``,
    ``model.load_state_dict`` (keys without ``module.``) and ``isinstance(model, type(unet))`` on them.
    The caller goes on with the same list (what the hooks left in it), so it gets the module too;
    ``unwrap_model`` and the strategies take either."""
    import sys

    parallel = sys.modules.get("torch.nn.parallel")  # loaded with torch; no DDP without it
    ddp = getattr(parallel, "DistributedDataParallel", None)
    if ddp is not None:
        models[:] = [m.module if isinstance(m, ddp) else m for m in models]


class CheckpointSession:
    """What an Accelerator's checkpoint methods keep between calls (``Accelerator._checkpoints``).

    ``background`` (the save running on a thread, with its staging buffers) belongs to this
    process: it is not pickled, and ``release`` drops it (``free_memory``).
    """

    def __init__(self) -> None:
        self.save_pre_hooks = PreHooks()
        self.load_pre_hooks = PreHooks()
        self.background: Optional[commit.Background] = None

    def background_save(self) -> commit.Background:
        """The background saver, made at the first ``save_state(blocking=False)``."""
        if self.background is None:
            self.background = commit.Background()
        return self.background

    def wait(self) -> None:
        """Block until a background save in progress is committed; raise if it failed."""
        if self.background is not None:
            self.background.wait()

    def release(self) -> None:
        """Drop the background saver and its staging buffers (after ``wait``): unpinned now, freed
        once nothing refers to them (they are not handed out beyond the save that used them)."""
        if self.background is not None:
            self.background.stager.release()
        self.background = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["background"] = None  # a thread and staging buffers of this process
        return state
