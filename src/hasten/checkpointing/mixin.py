"""``save_state`` / ``load_state``: the ``Accelerator``'s checkpoint methods.

What ``save_state`` gathers here (the target, this process's items, the manifest head) goes to
``commit.write_and_commit``, where the commit protocol reads top to bottom.
A crash at any point leaves either a complete checkpoint or a temporary folder that discovery ignores.
"""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from . import commit, layout, resume, rng, saver, solo
from .collectives import broadcast_from_main
from .loading import load_checkpoint
from .prehooks import CheckpointSession
from ..warning_kinds import HastenWarning


class CheckpointMixin:
    """``save_state``, ``load_state``, their pre-hooks and the ``resume`` switch.

    Their state lives in ``self._checkpoints`` (a ``prehooks.CheckpointSession``: the pre-hooks and
    the background saver) and ``self._auto_resume``, both declared by ``Accelerator.__init__``.
    """

    _checkpoints: CheckpointSession

    # -- hooks --------------------------------------------------------------------------------------
    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """Call ``hook(models, weights, output_dir)`` in ``save_state`` before anything is written.

        ``weights`` holds the state dict of each model; a hook that saves a model itself removes it
        (and its entry) from both lists. ``output_dir`` is the checkpoint's temporary folder: files the
        hook writes there become part of the checkpoint and are committed with it.
        Returns a handle whose ``remove()`` unregisters the hook.
        """
        return self._checkpoints.save_pre_hooks.register(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """Call ``hook(models, input_dir)`` in ``load_state`` once the checkpoint has been verified.

        A hook that loads a model itself removes it from ``models``. Returns a removable handle.
        """
        return self._checkpoints.load_pre_hooks.register(hook)

    # -- resume switch ------------------------------------------------------------------------------
    # The plan lives in ``self._auto_resume`` (an ``AutoResume`` or None, declared by
    # ``Accelerator.__init__``); ``prepare`` and ``register_for_checkpointing`` call the two steps below.
    @property
    def resume(self) -> Optional[str]:
        """None, "auto" or a checkpoint folder: what ``prepare`` restores automatically."""
        return self._auto_resume.source if self._auto_resume is not None else None

    @resume.setter
    def resume(self, value: Any) -> None:
        source = resume.check_resume(value)
        if source == "auto" and not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError(
                "resume='auto' continues from project_dir/checkpoints, which needs "
                "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)"
            )
        self._auto_resume = resume.AutoResume(self, source) if source is not None else None

    def _resume_if_pending(self) -> None:
        """End of ``prepare``: restore the checkpoint once everything it holds has been prepared."""
        if self._auto_resume is not None:
            self._auto_resume.maybe_resume()

    def _restore_registered_since(self, first: int) -> None:
        """End of ``register_for_checkpointing``: objects registered after the resume get their saved state."""
        if self._auto_resume is not None:
            self._auto_resume.restore_custom(first)

    # -- preemption ---------------------------------------------------------------------------------
    def save_on_preemption(self, signals: Sequence[int] = (signal.SIGTERM,), exit_code: int = 0,
                           output_dir: Optional[str] = None, dataloaders: Optional[Sequence[Any]] = None) -> Any:
        """On ``signals`` (default SIGTERM): ``save_state`` at the next step boundary, then exit.

        The boundary is the moment the loop asks a prepared dataloader (``dataloaders``, default: all
        prepared so far) for its next batch, so the checkpoint resumes exactly. Call it after
        ``prepare`` on every process; with several processes every listed dataloader must be
        iterated by all of them. Returns the handler (``uninstall()`` removes it).
        """
        from .preemption import PreemptionHandler

        loaders = list(self._dataloaders if dataloaders is None else dataloaders)
        if not loaders:
            raise ValueError("save_on_preemption needs a prepared dataloader (its batches mark the step boundaries); "
                             "call it after accelerator.prepare(...)")
        if not self.project_configuration.automatic_checkpoint_naming and output_dir is None:
            raise ValueError("save_on_preemption needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        handler = PreemptionHandler(self, loaders, signals, exit_code, output_dir)
        handler.install()
        return handler

    # -- save ---------------------------------------------------------------------------------------
    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, *,
                   blocking: bool = True, **save_model_func_kwargs: Any) -> str:
        """Save the whole training state atomically; returns the checkpoint folder.

        Holds every prepared model (safetensors), optimizer, scheduler, the gradient scaler, each
        process's RNG states, each prepared dataloader's position, the step counter, partial
        gradients when saved inside an accumulation window, and every object given to
        ``register_for_checkpointing``. With ``automatic_checkpoint_naming`` the folder is
        ``project_dir/checkpoints/checkpoint_N`` (``output_dir`` is then ignored) and ``total_limit``
        applies. Call it on every process. An unsharded state (one process, DDP) saved into
        ``output_dir`` may also be saved by process 0 alone (``if accelerator.is_main_process:``):
        process 0 commits without waiting, and the other processes' own state (generators, partial
        gradients) is then missing from the checkpoint, as in Accelerate. Where every process must take
        part (sharded states, automatic naming), a call by one process raises after a bounded wait.
        The random generators are recorded after the save pre-hooks ran, as Accelerate does.

        ``blocking=False`` returns once the state is copied into host memory (buffers kept for the
        next save) and writes, fsyncs and commits on a background thread while training goes on. The
        folder appears when the checkpoint is complete; ``wait_for_checkpoint()`` blocks until then
        and raises if it failed. The next ``save_state``/``load_state``/``end_training`` waits for
        it too, and so does the interpreter at exit.
        """
        pc = self.project_configuration
        staging_limit = getattr(pc, "staging_memory_limit", None)
        if not blocking and staging_limit is not None:  # also a value set after construction, before any collective
            from ..utils.dataclasses import staging_limit_bytes

            staging_limit = staging_limit_bytes(staging_limit)
        if not safe_serialization:
            warnings.warn("save_state(safe_serialization=False): hasten checkpoints always store weights as "
                          "safetensors", HastenWarning, stacklevel=2)
        if save_model_func_kwargs:
            warnings.warn(f"save_state ignores {sorted(save_model_func_kwargs)} (DeepSpeed/Megatron options)",
                          HastenWarning, stacklevel=2)
        if not pc.automatic_checkpoint_naming and output_dir is None:
            raise ValueError("save_state needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        pending = self._auto_resume.unresolved() if self._auto_resume is not None else None
        if pending:
            raise RuntimeError(pending + "; saving now would overwrite the run's history")
        self.wait_for_checkpoint()  # one save at a time; a failed background save is reported here
        cause = solo.collective_cause(self)
        background = self._checkpoints.background_save() if not blocking else None
        if background is not None:  # read at every save: a lowered limit releases what no longer fits
            background.stager.limit = staging_limit
        if cause is None:  # no collective: process 0 commits alone, the others attach their own files
            save = solo.save_as_main if self.is_main_process else solo.save_as_other
            target = save(self, output_dir, background)
            pc.iteration += 1
            return target
        # Before the first collective: a call made by one process is an error, not a hang.
        solo.check_arrival(self.process_index, self.num_processes, cause)
        self._refuse_sharded_on_each_node()
        choice = broadcast_from_main([self._choose_target(output_dir) if self.is_main_process else None])[0]
        if isinstance(choice, str):
            raise ValueError(choice)
        target, number, token = choice
        folder = layout.temp_path(target, token)
        writes_shared, node = self.is_main_process, 0
        if pc.save_on_each_node and self.state.num_machines > 1:
            folder, writes_shared, node = self._node_folder(target, token)
        # Processes may hold different save hooks (one process registers a hook of its own): every
        # process learns the largest count with the folder agreement, and agrees before each hook
        # index up to it, so that the agreements stay paired.
        hooks = list(self._checkpoints.save_pre_hooks.hooks.values())
        hook_rounds = max(self._agree_on_folder(folder, writes_shared, len(hooks)))
        mid_window = self._mid_window()
        contents: dict[str, Any] = {}
        write_shards = listing = None
        group = commit.save_group() if background is not None else None  # the save's exchanges, apart from training's
        prepared: tuple
        problem: Optional[str] = None  # this process's first failure, agreed before each collective below

        def attempt(step: Callable[[], Any]) -> Any:
            nonlocal problem
            if problem is None:
                try:
                    return step()
                except Exception as e:  # noqa: BLE001 - every process must learn that the save failed
                    problem = f"process {self.process_index}: {type(e).__name__}: {e}"
            return None

        def before_collective() -> None:
            # A step that may be collective (a sharded model's gathers, a save hook, the DCP planning)
            # is entered by every process or by none: one that failed alone would leave the others waiting.
            self._agree_or_remove(problem, folder, writes_shared)

        backend = self.strategy.checkpoint_backend()  # None: one full file per model/optimizer
        dcp_format = backend is not None
        models = list(self._models)
        if dcp_format:
            attempt(lambda: backend.refuse(blocking, mid_window))
        contents = attempt(lambda: self._contents(writes_shared)) or {}
        weights: list = []
        if not dcp_format:
            for model in models:
                before_collective()
                weights.append(attempt(lambda: self.get_state_dict(model)))
        for index in range(hook_rounds):
            before_collective()
            if index < len(hooks):
                attempt(lambda: hooks[index](models, weights, folder))
        # After the hooks, as Accelerate records them: a hook that draws random numbers (diffusers' do)
        # must not make the resumed run differ from the uninterrupted one.
        rng_state = rng.capture()
        if dcp_format:
            before_collective()

            def plan_sharded() -> Any:
                inner = [self.unwrap_model(m, keep_torch_compile=False) for m in models]
                contents["models"], with_state = backend.entries(inner, self._optimizers)
                for i, entry in enumerate(contents["optimizers"]):
                    entry[backend.KEY] = backend.optimizer_entry(i, with_state[i])
                staging = {"stager": background.stager} if background is not None else {}  # copy shards now
                return backend.writer(self, folder, inner, with_state, group, **staging), backend.listing

            write_shards, listing = attempt(plan_sharded) or (None, None)

        def local_items() -> list:  # no collective from here to the exchange in write_and_commit
            items = self._own_items(models, weights, contents, rng_state, writes_shared, backend, mid_window)
            if background is not None:
                items = background.stager.stage(items)
            return items

        items = attempt(local_items)
        prepared = ("error", problem) if problem is not None else ("ok", items)
        job = commit.SaveJob(folder, target, token, number, self.process_index, self.num_processes, node,
                             writes_shared, self._manifest_head(number, mid_window, contents), pc.total_limit,
                             sharded=write_shards, listing=listing)
        if background is None:
            commit.write_and_commit(job, prepared)
        else:
            background.start(target, lambda: commit.write_and_commit(job, prepared, group))
        pc.iteration = (number if number is not None else pc.iteration) + 1
        return target

    def _mid_window(self) -> bool:
        return self.gradient_accumulation_steps > 1 and self.step % self.gradient_accumulation_steps != 0

    def _own_items(self, models: list, weights: list, contents: dict, rng_state: dict, writes_shared: bool,
                   backend: Any, mid_window: bool) -> list:
        """This process's files of a save: the shared ones when it writes them, then its own."""
        # Hooks may drop weights (a model they saved themselves) without dropping the model.
        dcp_format = backend is not None
        classes = [type(self.unwrap_model(m)).__name__ for m in models] if len(models) == len(weights) or dcp_format else []
        if not dcp_format:
            contents["models"] = [{"file": saver.indexed("model", i)} for i in range(len(weights))]
        for i, entry in enumerate(contents["models"]):
            entry.update({"class": classes[i]} if classes else {})
        items = saver.shared_items(weights, self, contents, backend) if writes_shared else []
        return items + saver.process_items(self, rng_state, mid_window)

    def wait_for_checkpoint(self) -> None:
        """Block until a ``save_state(blocking=False)`` in progress is committed; raise if it failed."""
        self._checkpoints.wait()

    def _manifest_head(self, number: Optional[int], mid_window: bool, contents: dict) -> dict[str, Any]:
        """The manifest without its file list, as of the moment the save was asked for."""
        from .. import __hasten_version__

        pc = self.project_configuration
        return {
            "format": layout.FORMAT, "format_version": layout.FORMAT_VERSION, "hasten_version": __hasten_version__,
            "torch_version": torch.__version__, "world_size": self.num_processes,
            "num_machines": self.state.num_machines, "save_on_each_node": bool(pc.save_on_each_node),
            "iteration": number if number is not None else pc.iteration, "step": int(self.step),
            "gradient_accumulation_steps": int(self.gradient_accumulation_steps), "mid_accumulation": mid_window,
            "mixed_precision": str(self.mixed_precision), "contents": contents,
            "layout": self.strategy.describe(),  # strategy, mesh shape, state-dict kind: checked by load_state
        }

    def _choose_target(self, output_dir: Optional[str]) -> Any:
        pc = self.project_configuration
        token = layout.new_token()
        try:
            if pc.automatic_checkpoint_naming:
                if output_dir is not None:
                    warnings.warn("save_state(output_dir) is ignored with automatic_checkpoint_naming",
                                  HastenWarning, stacklevel=3)
                root = layout.auto_root(pc.project_dir)
                os.makedirs(root, exist_ok=True)
                layout.recover_all(root)  # before numbering: a recovered checkpoint keeps its number
                number = layout.next_number(root, pc.iteration)
                return os.path.join(root, f"checkpoint_{number}"), number, token
            target = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.exists(target) and not os.path.isdir(target):
                return f"save_state: output_dir={output_dir!r} is a file; pass a folder path"
            layout.recover(target)  # the checkpoint a crash mid-replace hid comes back, then is replaced
            return target, None, token
        except Exception as e:  # noqa: BLE001 - every process raises it (a lone raise would leave the others waiting)
            return f"save_state: {type(e).__name__}: {e}"

    def _refuse_sharded_on_each_node(self) -> None:
        """``save_on_each_node`` on several machines with a sharded backend: refused before anything is
        written or deleted, on every process alike (each sees the same configuration; no collective).

        Sharded files (DCP shards, DeepSpeed engine files) are written by every process and read back
        by every process; split over per-node folders, no node would hold a loadable checkpoint, and
        retention would already have deleted the older good ones."""
        pc = self.project_configuration
        if not (pc.save_on_each_node and self.state.num_machines > 1):
            return
        backend = self.strategy.checkpoint_backend()
        if backend is None:
            return
        name = getattr(backend, "NAME", None) or "torch.distributed.checkpoint"
        raise ValueError(
            f"save_state: ProjectConfiguration(save_on_each_node=True) on {self.state.num_machines} machines cannot "
            f"save a sharded ({name}) checkpoint: every process writes its own shards and needs all of them back, so "
            "per-node folders would hold unloadable pieces. Save to a filesystem shared by all machines with "
            "save_on_each_node=False (nothing was written and no checkpoint was deleted)"
        )

    def _agree_on_folder(self, folder: str, writes_shared: bool, share: Any = None) -> list:
        """Create this process's temporary folder; every process learns whether every one could, before
        anything collective (a save hook, a sharded model's gathers): a process that failed alone would
        skip those and leave the others waiting. On a failure every process raises the same error and
        nothing is left behind. Returns every process's ``share``."""
        problem = None
        try:
            os.makedirs(folder, exist_ok=True)
        except Exception as e:  # noqa: BLE001 - every process must learn it
            problem = f"process {self.process_index}: {type(e).__name__}: {e}"
        return self._agree_or_remove(problem, folder, writes_shared and problem is None, share)

    @staticmethod
    def _agree_or_remove(problem: Optional[str], folder: str, writes_shared: bool, share: Any = None) -> list:
        """Every process learns whether any failed so far; on a failure every process raises the same
        error and the temporary folder is removed (by the process that created it)."""
        try:
            return commit.agree(problem, "save_state failed; nothing was committed:", share=share)
        except RuntimeError:
            if writes_shared:
                layout.remove_tree(folder)
            raise

    def _node_folder(self, target: str, token: str) -> tuple[str, bool, int]:
        """(folder, writes shared files, node) with ``save_on_each_node`` on several machines: a
        folder per node, unless the filesystem turns out to be shared (then one folder, as usual).
        Each step that may fail on one node is followed by an agreement, never by a lone raise."""
        node = self.state.topology.node_rank
        mine = layout.temp_path(target, token) + f"-node{node}"
        problem = None
        if self.is_local_main_process:
            try:
                os.makedirs(mine, exist_ok=True)
            except Exception as e:  # noqa: BLE001 - every process must learn it
                problem = f"process {self.process_index}: {type(e).__name__}: {e}"
        try:
            commit.agree(problem, "save_state failed; nothing was committed:")  # also: every node's folder exists now
        except RuntimeError:
            if self.is_local_main_process and problem is None:
                layout.remove_tree(mine)
            raise
        shared: list = [None]
        if self.is_main_process:
            prefix = os.path.basename(layout.temp_path(target, token)) + "-node"
            try:
                shared[0] = any(n.startswith(prefix) and n != prefix + "0"
                                for n in os.listdir(os.path.dirname(target)))
            except Exception as e:  # noqa: BLE001 - sent to every process below
                shared[0] = f"save_state failed; nothing was committed:\n  - process 0: {type(e).__name__}: {e}"
        shared = broadcast_from_main(shared)
        if isinstance(shared[0], str):
            if self.is_local_main_process:
                layout.remove_tree(mine)
            raise RuntimeError(shared[0])
        if shared[0]:
            if self.is_local_main_process:
                try:
                    os.rmdir(mine)
                except OSError:  # an empty folder left behind: no reason to fail this process alone
                    pass
            return layout.temp_path(target, token), self.is_main_process, 0
        return mine, self.is_local_main_process, node

    def _contents(self, writes_shared: bool) -> dict[str, Any]:
        return {
            "models": [],
            "optimizers": [{"file": saver.indexed("optimizer", i), "class": saver.class_name(o)}
                           for i, o in enumerate(self._optimizers)],
            "schedulers": [{"file": saver.indexed("scheduler", i), "class": saver.class_name(s)}
                           for i, s in enumerate(self._schedulers)],
            "scaler": "scaler.safetensors" if self.precision.scaler is not None else None,
            "dataloaders": [saver.loader_info(dl, self.strategy.mesh.dp_size) for dl in self._dataloaders],
            # Only the writer asks each object whether its state needs pickle (that costs a state_dict()).
            "custom_objects": saver.plan_custom(self._custom_objects) if writes_shared else [],
        }

    # -- load ---------------------------------------------------------------------------------------
    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, *,
                   verify: str = "checksum", continue_dataloaders: bool = False, **load_model_func_kwargs: Any) -> str:
        """Restore everything ``save_state`` stored; returns the checkpoint folder used.

        Without ``input_dir`` (and with automatic naming) the newest *complete* checkpoint of
        ``project_dir/checkpoints`` is used, and the numbering of later saves continues after it.
        Before anything changes, on every process: the manifest (format version, file list), every
        file's size and checksum (every byte is read once more; see bench/checkpoint.py for the cost),
        and every saved object against the live one (count, class, tensor names and shapes); any
        damage raises one error naming the file, on every process, before anything changes.
        ``verify="size"`` skips the checksums (faster, for checkpoints you just wrote yourself).
        Pickled registered objects load only with ``load_kwargs={"weights_only": False}``.
        Prepared dataloaders start their interrupted epoch again, as under Accelerate (a loop skips the
        trained batches itself, or through ``skip_first_batches``); ``continue_dataloaders=True`` (and
        stateful loaders) continue at the saved batch instead.
        """
        self.wait_for_checkpoint()
        if verify not in ("checksum", "size"):
            raise ValueError(f"load_state(verify={verify!r}): use 'checksum' (the default) or 'size'")
        load_model_func_kwargs["_verify_checksums"] = verify == "checksum"
        load_model_func_kwargs["continue_dataloaders"] = continue_dataloaders
        return load_checkpoint(self, input_dir, load_kwargs or {}, load_model_func_kwargs)
