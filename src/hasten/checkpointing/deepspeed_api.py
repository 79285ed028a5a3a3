"""The private DeepSpeed interfaces hasten's checked DeepSpeed loading relies on, checked before use.

hasten reads DeepSpeed checkpoints through DeepSpeed's own private functions (``zero_to_fp32``'s
helpers) and swaps the engine's ``checkpoint_engine`` for a reader of checked files. A DeepSpeed release
that renames or re-signs one of them must not look like a damaged checkpoint: each is bound before it
is called, and a mismatch is a ``DeepSpeedVersionError`` naming what hasten needs and what the installed
DeepSpeed has (nothing is loaded). A leaf: imports nothing of hasten's.
"""

from __future__ import annotations

from typing import Any, Optional


class DeepSpeedVersionError(RuntimeError):
    """The installed DeepSpeed lacks (or changed) a private function or attribute hasten uses: nothing is
    loaded, rather than a load through an interface hasten was not written for."""


def version_error(needed: str, found: str) -> DeepSpeedVersionError:
    """One error naming what hasten needs from DeepSpeed, what the installed version has, and that version."""
    try:
        from importlib.metadata import version

        installed = version("deepspeed")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        installed = "(unknown version)"
    return DeepSpeedVersionError(
        f"hasten's checked DeepSpeed loading needs deepspeed's {needed}; deepspeed {installed} has {found}. This "
        "DeepSpeed version changed a private interface hasten relies on (nothing was loaded and the checkpoint "
        "is not judged damaged): install a DeepSpeed version hasten supports (tested: 0.19) or report it")


def bindable(owner: Any, name: str, args: tuple, shown: str, kwargs: Optional[dict] = None) -> Any:
    """``owner.name``, after checking that it exists and accepts ``args``/``kwargs`` (``inspect.signature``);
    else ``DeepSpeedVersionError``."""
    import inspect

    function = getattr(owner, name, None)
    if not callable(function):
        raise version_error(f"{shown}", "no such function")
    try:
        inspect.signature(function).bind(*args, **(kwargs or {}))
    except TypeError as e:
        raise version_error(f"{shown} to accept the arguments hasten passes ({e})",
                            f"{shown}{inspect.signature(function)}") from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass
    return function


def zero_call(zero_to_fp32: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``zero_to_fp32.<name>(*args, **kwargs)``: a private DeepSpeed function, bound before it is called so a
    changed signature is a ``DeepSpeedVersionError``, never "incomplete or damaged"."""
    return bindable(zero_to_fp32, name, args, f"deepspeed.utils.zero_to_fp32.{name}", kwargs)(*args, **kwargs)


def check_engine_api(engine: Any) -> None:
    """Raise ``DeepSpeedVersionError`` unless ``engine`` has what a checked load swaps and calls: its
    ``checkpoint_engine`` attribute, ``load_checkpoint(path, tag=)``, and DeepSpeed's ``CheckpointEngine``
    with ``load(path, map_location)`` (``checkpoint_engine_class`` checks the class)."""
    if not hasattr(engine, "checkpoint_engine"):
        raise version_error("DeepSpeedEngine.checkpoint_engine (the object its load_checkpoint reads files through)",
                            f"engines ({type(engine).__name__}) without it")
    bindable(type(engine), "load_checkpoint", (engine, "path"), "DeepSpeedEngine.load_checkpoint", {"tag": "t"})
    checkpoint_engine_class()


def checkpoint_engine_class() -> Any:
    """DeepSpeed's ``CheckpointEngine`` class (what ``deepspeed_state.checked_engine`` subclasses), after
    checking the methods hasten's checked reader implements or inherits: ``save``, ``commit`` and
    ``load(path, map_location)`` exactly; else ``DeepSpeedVersionError``."""
    try:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    except ImportError as e:
        raise version_error("deepspeed.runtime.checkpoint_engine.checkpoint_engine.CheckpointEngine",
                            f"no such class ({e})") from None
    import inspect

    for name, args in (("save", ({}, "path")), ("commit", (None,))):
        bindable(CheckpointEngine, name, (None, *args), f"CheckpointEngine.{name}")
    load = bindable(CheckpointEngine, "load", (None, "path"), "CheckpointEngine.load", {"map_location": None})
    if list(inspect.signature(load).parameters) != ["self", "path", "map_location"]:
        # DeepSpeed may pass what the new parameters mean; a reader that ignored them could load wrongly
        raise version_error("CheckpointEngine.load(path, map_location) (what hasten's checked reader implements)",
                            f"CheckpointEngine.load{inspect.signature(load)}")

    return CheckpointEngine
