"""Resuming: dataloader positions across world sizes, and the ``resume="auto"`` switch.

Position rule when the number of processes (or the global batch size) changed: a prepared loader
saved ``batches_yielded`` steps of ``total_batch_size`` samples each into its epoch, i.e.
``samples = batches_yielded * total_batch_size`` samples of the epoch's (world-size independent)
sample order. The resumed loader starts at ``samples // new_total_batch_size`` steps; when that does
not divide, the few samples of the partial step are seen again and a warning says how many.
Random number generators: process ``r`` takes the saved states of process ``r % saved_world_size``.
A checkpoint saved inside a gradient-accumulation window holds per-process partial gradients and
only resumes with the same number of processes.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

from . import layout
from .collectives import broadcast_from_main
from ..warning_kinds import HastenWarning

RESUME_CHOICES = ("auto", "auto-skip-damaged", "never")
# resume="auto" never starts over silently: a committed checkpoint that no longer loads is an error naming it.
# "auto-skip-damaged" passes over such checkpoints (with a warning) to the newest one that loads, or a fresh start.
SKIP_DAMAGED = "auto-skip-damaged"


def convert_loader_state(state: dict[str, Any], saved: dict[str, Any], dataloader: Any, index: int,
                         live_processes: int) -> dict[str, Any]:
    """``state`` (a prepared loader's ``state_dict``) for ``dataloader`` in this run."""
    new_total = getattr(dataloader, "total_batch_size", None)
    old_total = saved.get("total_batch_size")
    same = saved.get("num_processes") == live_processes and old_total == new_total
    if same:
        return state
    # The shuffle seed and the state of the (process-synchronised) sampler generator at the start of
    # the pass decide the epoch's sample order for every number of processes; the rest is per process.
    state = {k: v for k, v in state.items() if k in ("epoch", "batches_yielded", "sampler_seed",
                                                     "sampler_epoch_seed", "sampler_generator_state")}
    done = int(state.get("batches_yielded", 0))
    if not done:
        return state
    if not old_total or not new_total:
        raise ValueError(
            f"dataloader {index}: cannot convert its position ({done} batches) to the new number of processes, "
            "because its batch size is unknown; resume with the same number of processes"
        )
    samples = done * old_total
    steps, rest = divmod(samples, new_total)
    if rest:
        warnings.warn(
            f"dataloader {index}: {samples} samples of epoch {state.get('epoch')} were consumed in batches of "
            f"{old_total}; with batches of {new_total} the resume starts at sample {steps * new_total}, so "
            f"{rest} samples are seen twice", HastenWarning,
            stacklevel=4,
        )
    state["batches_yielded"] = steps
    return state


def saved_rank_for(rank: int, saved_world_size: int) -> int:
    return rank % saved_world_size


# -- resume="auto" -------------------------------------------------------------------------------------
def check_resume(value: Any) -> Optional[str]:
    """None (off), "auto", or a checkpoint path."""
    if value is None or value is False or value == "never":
        return None
    if value is True:
        return "auto"
    if isinstance(value, (str, os.PathLike)):
        if value in ("auto", SKIP_DAMAGED):
            return value
        path = os.path.abspath(os.path.expanduser(os.fspath(value)))
        if not os.path.isdir(path) and not layout.find_leftover(path):  # a leftover: put back by locate()
            raise ValueError(f"resume={value!r} is neither 'auto' nor an existing checkpoint folder; pass "
                             "resume='auto' (or 'auto-skip-damaged') or the folder of a checkpoint written by "
                             "save_state")
        return os.fspath(value)
    raise ValueError(
        f"resume={value!r} is not understood; use resume='auto' (continue from the newest complete checkpoint "
        "in project_dir/checkpoints, or start fresh when there is none), 'auto-skip-damaged' (the same, passing "
        "over checkpoints that no longer load), a checkpoint folder, or None"
    )


class AutoResume:
    """Restores a checkpoint as soon as the run has prepared what the checkpoint holds.

    Held by ``Accelerator(resume=...)`` (its ``resume`` setter); ``Accelerator.prepare`` calls
    ``maybe_resume`` at its end, which compares the prepared models, optimizers, schedulers and
    dataloaders with the checkpoint's and calls ``load_state`` once they match.
    ``register_for_checkpointing`` calls ``restore_custom``: objects registered after the resume get
    their saved state when they are registered.
    """

    def __init__(self, accelerator: Any, source: str) -> None:
        self.accelerator = accelerator
        self.source = source
        self.folder: Optional[str] = None
        self.contents: Optional[dict] = None
        self.done = False
        self.pending_custom: list[Any] = []  # saved states of objects not yet registered
        self.passed_over: dict[str, str] = {}  # "auto-skip-damaged": folders whose load failed -> why

    def locate(self) -> tuple[Optional[str], Any]:
        """(folder, its contents) to resume from, decided by process 0; (None, None): fresh start.
        Any problem reading it is returned as a string so that every process raises it."""

        acc = self.accelerator
        found: list[Any] = [(None, None)]
        if acc.is_main_process:
            try:
                if self.source in ("auto", SKIP_DAMAGED):
                    folder = self._newest_loadable()
                else:
                    folder = os.path.abspath(os.path.expanduser(self.source))
                    layout.recover(folder)
                found[0] = (folder, layout.read_full_manifest(folder)["contents"] if folder else None)
            except Exception as e:  # noqa: BLE001 - raised on every process below, never on this one alone
                found[0] = (None, f"resume={self.source!r}: {type(e).__name__}: {e}")
        return broadcast_from_main(found)[0]

    def _newest_loadable(self) -> Optional[str]:
        """The newest numbered checkpoint whose manifest reads, on process 0 (``newest_checkpoint``): no
        checkpoint means a fresh start, so folders of which none loads are an error too under "auto"."""
        root = layout.auto_root(self.accelerator.project_configuration.project_dir)
        return newest_checkpoint(root, f"resume={self.source!r}", skip_damaged=self.source == SKIP_DAMAGED,
                                 passed_over=self.passed_over, fresh_start=True)

    def maybe_resume(self) -> None:
        if self.done:
            return
        acc = self.accelerator
        if self.contents is None:
            self.folder, contents = self.locate()
            if isinstance(contents, str):  # a ValueError, as before; the checkpoint errors' class
                raise layout.IncompleteCheckpointError(contents)
            if self.folder is None:
                self.done = True  # fresh start
                return
            self.contents = contents
        counts = {"models": len(acc._models), "optimizers": len(acc._optimizers),
                  "schedulers": len(acc._schedulers), "dataloaders": len(acc._dataloaders)}
        saved = {key: len(self.contents[key]) for key in counts}
        if any(counts[k] < saved[k] for k in counts):
            return  # more prepare() calls to come
        self.done = True
        try:
            acc.load_state(self.folder, _custom_later=True, continue_dataloaders=True)  # loops need no skipping
        except (layout.IncompleteCheckpointError, layout.CheckpointNotFoundError) as e:
            self._pass_over(e)
        except Exception as e:  # noqa: BLE001 - CheckpointCorruptError (fileio is imported with torch)
            from ..files.errors import CheckpointCorruptError

            if not isinstance(e, CheckpointCorruptError):
                raise
            self._pass_over(e)

    def _pass_over(self, error: Exception) -> None:
        """Under ``resume="auto-skip-damaged"``: try the next older checkpoint (nothing was changed by the
        failed load, on any process: every process raised the same error). Else the error stands."""
        if self.source != SKIP_DAMAGED:
            raise error
        self.passed_over[self.folder] = str(error)
        self.folder, self.contents, self.done = None, None, False
        self.pending_custom = []
        self.maybe_resume()

    def restore_custom(self, first: int) -> None:
        acc = self.accelerator
        for index in range(first, len(acc._custom_objects)):
            if index < len(self.pending_custom) and self.pending_custom[index] is not None:
                acc._custom_objects[index].load_state_dict(self.pending_custom[index])
                self.pending_custom[index] = None

    def unresolved(self) -> Optional[str]:
        """Why the resume has not happened yet (checked before the next save), or None."""
        if self.contents is None or self.done and not any(s is not None for s in self.pending_custom):
            return None
        if not self.done:
            return (f"resume: checkpoint {self.folder!r} holds {len(self.contents['models'])} models, "
                    f"{len(self.contents['optimizers'])} optimizers, {len(self.contents['schedulers'])} schedulers "
                    f"and {len(self.contents['dataloaders'])} dataloaders, but fewer were prepared, so nothing was "
                    "restored; prepare the same objects as the run that saved it")
        missing = [i for i, s in enumerate(self.pending_custom) if s is not None]
        return (f"resume: checkpoint {self.folder!r} holds registered objects {missing} that were never given to "
                "register_for_checkpointing in this run")


def newest_checkpoint(root: str, caller: str, skip_damaged: bool = False, passed_over: Optional[dict] = None,
                      fresh_start: bool = False) -> Optional[str]:
    """The newest numbered checkpoint in ``root`` whose manifest reads (None: none does): the one rule of
    ``resume="auto"`` and of ``load_state()`` without a folder, run on process 0.

    Newer folders without a manifest (a save that never committed, another library's) are passed over
    with a warning. A newer checkpoint that was committed but is damaged now raises naming each folder
    and why (training must not silently lose steps), unless ``skip_damaged`` (``resume="auto-skip-damaged"``).
    ``fresh_start``: the caller starts over when None is returned, so folders of which none loads raise too.
    ``passed_over``: folders a load already failed on (folder -> why), counted as committed but damaged."""
    from ..files.errors import CheckpointCorruptError

    layout.recover_all(root)  # complete checkpoints a crash left under temporary names
    passed: list[tuple[str, str, bool]] = []  # (folder, why, committed)
    folder = None
    for _, path in reversed(layout.numbered(root)):
        if passed_over and path in passed_over:
            passed.append((path, passed_over[path], True))
            continue
        try:
            layout.read_manifest(path)
        except (layout.IncompleteCheckpointError, layout.CheckpointNotFoundError, CheckpointCorruptError,
                OSError) as e:
            passed.append((path, str(e), os.path.lexists(os.path.join(path, layout.MANIFEST))))
            continue
        folder = path
        break
    committed = [p for p in passed if p[2]]
    if not skip_damaged and (committed or (fresh_start and passed and folder is None)):
        lines = "\n  - ".join(f"{path}: {why}" for path, why, _ in (committed or passed))
        if committed:
            what = (f"{len(committed)} checkpoint(s) newer than {folder!r} were" if folder else
                    "the checkpoints there were")
            what += " committed but cannot be loaded now (damaged after the save)"
        else:
            what = "it holds checkpoint folders but none of them can be loaded"
        lose = "lose their steps or start over" if fresh_start else "lose their steps"
        skip = ("pass resume='auto-skip-damaged' to continue from the newest checkpoint that loads (or from "
                "scratch when none does)" if fresh_start else "pass the folder of an older checkpoint to load it")
        raise layout.IncompleteCheckpointError(
            f"{caller} in {root!r}: {what}; nothing was loaded, so the run would {lose}:\n  - {lines}\n"
            f"Restore or remove the folders named, load one yourself with load_state(folder), or {skip}")
    layout.warn_skipped([f"{path}: {why}" for path, why, _ in passed])
    return folder
