"""``load_state``: find, verify, compare, then restore (in that order, on every process)."""

from __future__ import annotations

import os
import pickle
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from ..saving import CheckpointMismatchError
from ..state import warn_once
from . import accelerate_folder, backends, layout, restorer, resume, rng, saver, solo
from .collectives import broadcast_from_main, gather
from ..files.checksum import HASH_THREADS
from ..files.errors import CheckpointCorruptError
from ..warning_kinds import HastenWarning

_KINDS = {
    "mismatch": CheckpointMismatchError, "corrupt": CheckpointCorruptError,
    "incomplete": layout.IncompleteCheckpointError, "missing": layout.CheckpointNotFoundError,
    "pickle": pickle.UnpicklingError, "other": RuntimeError,
}


def _kind(error: BaseException) -> str:
    if isinstance(error, pickle.UnpicklingError):
        return "pickle"
    if isinstance(error, CheckpointCorruptError):
        return "corrupt"
    if isinstance(error, layout.CheckpointNotFoundError):
        return "missing"
    if isinstance(error, layout.IncompleteCheckpointError):
        return "incomplete"
    if isinstance(error, (CheckpointMismatchError, ValueError, KeyError, TypeError)):
        return "mismatch"
    return "other"


def _agree(problems: list[tuple[str, str]], folder: str) -> None:
    """Raise on every process if any process found a problem (before anything changed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # One small all-reduce on the usual path; the messages are gathered only when some process has one.
        from ..state import PartialState

        flag = torch.tensor([len(problems)], dtype=torch.int64, device=PartialState().device)
        dist.all_reduce(flag)
        if not int(flag.item()):
            return
    everyone = gather(problems)
    found = list(dict.fromkeys(p for rank in everyone for p in rank))
    if not found:
        return
    kind = _KINDS[found[0][0]]
    lines = "\n  - ".join(message for _, message in found)
    raise kind(f"cannot load checkpoint {folder!r} (nothing was changed):\n  - {lines}")


def resolve_folder(accelerator: Any, input_dir: Optional[str]) -> str:
    pc = accelerator.project_configuration
    if input_dir is not None:
        # As in save_state, the main process names the folder: a script that passes each process its
        # own (e.g. a per-process tempfile.TemporaryDirectory) reads back what save_state wrote.
        folder = os.path.abspath(os.path.expanduser(os.fspath(input_dir)))
        if accelerator.is_main_process:
            try:
                layout.recover(folder)  # a crash mid-replace may have left it under a temporary name
            except OSError:
                pass  # reported below as the folder being missing, on every process
        return broadcast_from_main([folder])[0]
    if not pc.automatic_checkpoint_naming:
        raise ValueError(
            "load_state() without input_dir needs ProjectConfiguration(automatic_checkpoint_naming=True); "
            "otherwise pass the checkpoint folder"
        )
    root = layout.auto_root(pc.project_dir)
    found: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            # the rule of resume="auto": a committed but damaged newest checkpoint is an error naming it
            found[0] = resume.newest_checkpoint(root, "load_state() without a folder")
        except (OSError, layout.IncompleteCheckpointError) as e:  # every process raises it, not the main one alone
            found[0] = e
    folder = broadcast_from_main(found)[0]
    if isinstance(folder, Exception):
        raise folder
    if folder is None:
        raise layout.CheckpointNotFoundError(
            f"no complete checkpoint in {root!r} to resume from; save one with save_state() first (or use "
            "Accelerator(resume='auto'), which starts fresh when there is none)"
        )
    return folder


def _shared_files(manifest: dict[str, Any]) -> list[str]:
    return [n for n, info in manifest["files"].items() if not str(n).startswith(("rank_", "grads_rank_"))
            or info.get("rank") == "hook"]


def load_checkpoint(acc: Any, input_dir: Optional[str], load_kwargs: dict, extra: dict) -> str:
    custom_later = bool(extra.pop("_custom_later", False))
    checksums = bool(extra.pop("_verify_checksums", True))
    continue_loaders = bool(extra.pop("continue_dataloaders", False))
    extra.pop("map_location", None)  # state always goes where the live objects are
    if extra:
        warnings.warn(f"load_state ignores {sorted(extra)} (DeepSpeed/Megatron options)", HastenWarning, stacklevel=3)
    allow_pickle = load_kwargs.get("weights_only", True) is False
    folder = resolve_folder(acc, input_dir)
    if broadcast_from_main([accelerate_folder.is_accelerate_folder(folder)])[0]:
        return accelerate_folder.load(acc, folder, allow_pickle, custom_later, _agree, _kind)
    pool = ThreadPoolExecutor(max(2, HASH_THREADS))  # two files at once, a big file's checksum in parts
    try:
        return _load(acc, folder, allow_pickle, custom_later, checksums, pool, continue_loaders)
    finally:
        pool.shutdown()


def _load(acc: Any, folder: str, allow_pickle: bool, custom_later: bool, checksums: bool,
          pool: ThreadPoolExecutor, continue_loaders: bool = False) -> str:
    # 1. the folder, its files, and what it holds vs this run
    problems: list[tuple[str, str]] = []
    manifest: dict[str, Any] = {}
    missing: Optional[str] = None  # why this process has no per-process state in the checkpoint
    reader: Optional[restorer.Reader] = None
    saved_world = acc.num_processes
    try:
        manifest = layout.read_full_manifest(folder)
        reader = restorer.Reader(folder, manifest, pool)
        saved_world = int(manifest["world_size"])
        source = resume.saved_rank_for(acc.process_index, saved_world)
        for message in restorer.check_counts(manifest, acc):
            if custom_later and "register_for_checkpointing" in message:
                continue
            problems.append(("mismatch", message))
        if manifest["mid_accumulation"] and saved_world != acc.num_processes:
            problems.append(("mismatch", f"it was saved inside a gradient-accumulation window (step {manifest['step']}"
                             f" of {manifest['gradient_accumulation_steps']}) by {saved_world} processes, whose "
                             f"partial gradients cannot be split over {acc.num_processes}; resume with {saved_world} "
                             "processes, or save where accelerator.sync_gradients is True"))
        own = _own_files(folder, manifest, source)
        if own is None:  # saved by process 0 alone: this process resumes without state of its own
            missing = solo.missing_note(folder, source, manifest["mid_accumulation"])
            own = [saver.rank_file(0)]  # its dataloader position and step counter are everyone's
        names = own + (_shared_files(manifest) if acc.is_local_main_process else [])
        if not problems:
            reader.verify(names, checksums)
    except Exception as e:  # noqa: BLE001 - one process failing must stop every process
        problems.append((_kind(e), f"process {acc.process_index}: {e}"))
    _agree(problems, folder)

    # 2. hooks, then read every state and compare it with the live objects
    models = list(acc._models)
    loaded: dict[str, Any] = {}
    try:
        acc._checkpoints.load_pre_hooks.run(models, folder)
        loaded = _read_states(acc, reader, manifest, models, allow_pickle, problems, missing is None)
    except Exception as e:  # noqa: BLE001
        problems.append((_kind(e), f"process {acc.process_index}: {type(e).__name__}: {e}"))
    _agree(problems, folder)

    # 3. apply: nothing below can fail on a checkpoint that passed the checks
    # Each file's bytes are let go as soon as its state is applied (the largest first: models, optimizers).
    with torch.no_grad():
        inner = [acc.unwrap_model(model, keep_torch_compile=False) for model in models]
        for i, (model, state, view) in enumerate(zip(inner, loaded["models"], loaded["model_views"])):
            if state is not None and not (acc.strategy.loads_full_weights_in_place(model)
                                          and restorer.read_model_in_place(model, view)):
                acc.strategy.load_model_state_dict(model, state)
            loaded["models"][i] = loaded["model_views"][i] = state = view = None
        for entry in manifest["contents"]["models"]:
            reader.release(entry.get("file"))
        if loaded["grads"] is not None:
            restorer.apply_gradients(acc, loaded["grads"])
        for i, (opt, name) in enumerate(zip(acc._optimizers, loaded["optimizer_files"])):
            state, loaded["optimizers"][i] = loaded["optimizers"][i], None
            if state is not None:
                restorer.apply_optimizer(opt, state, inner, acc.strategy)
            state = None
            reader.release(name)
    if loaded["sharded"] is not None:
        loaded["sharded"].load(folder, manifest["contents"], inner, acc._optimizers)
    acc.strategy.weights_loaded(inner)
    for sched, state in zip(acc._schedulers, loaded["schedulers"]):
        sched.load_state_dict(restorer.detach_state(state))
    if loaded["scaler"] is not None:
        acc.precision.load_state_dict(restorer.detach_state(loaded["scaler"]))
    for dl, state in zip(acc._dataloaders, loaded["dataloaders"]):
        restore_position(dl, restorer.detach_state(state), continue_loaders)
    unrestored = restorer.dataloader_note(folder, manifest, acc)
    if unrestored is not None:  # once per checkpoint: a script evaluating it again is told once
        warn_once(unrestored)
    custom = [restorer.detach_state(s) for s in loaded["custom"]]
    for obj, state in zip(acc._custom_objects, custom):
        obj.load_state_dict(state)
    auto = acc._auto_resume
    if custom_later and auto is not None:
        auto.pending_custom = [None] * len(acc._custom_objects) + custom[len(acc._custom_objects):]
    acc.step = int(loaded["rank"]["step"])
    acc.project_configuration.iteration = int(manifest["iteration"]) + 1
    notes = [missing] if missing else rng.restore(restorer.detach_state(loaded["rank"]["rng"]))
    reader.close()
    if saved_world != acc.num_processes:
        notes.append(f"the checkpoint was saved by {saved_world} processes and is resumed by {acc.num_processes}: "
                     f"dataloaders continue at the same sample, process r takes the random states of saved process "
                     f"r % {saved_world}, so the run is not bitwise identical to one that kept {saved_world} processes")
    for note in notes:
        warnings.warn(f"load_state: {note}", HastenWarning, stacklevel=3)
    return folder


def restore_position(dataloader: Any, state: dict, continue_loaders: bool) -> None:
    """Put a prepared loader where a resumed script expects it, as Accelerate does: at the start of
    the interrupted epoch (``restart_epoch``: that epoch's order, so the script's own skipping, or
    ``skip_first_batches``, lands on the batches not trained yet), unless the loader is stateful
    (``use_stateful_dataloader=True``) or ``continue_loaders`` (``load_state(continue_dataloaders=True)``,
    ``resume=``) asks for hasten's positioning: then it continues at the saved batch."""
    restarts = not (continue_loaders or getattr(dataloader, "use_stateful_dataloader", False))
    if restarts and hasattr(dataloader, "restart_epoch"):
        dataloader.restart_epoch(state)
    elif hasattr(dataloader, "load_state_dict"):
        dataloader.load_state_dict(state)


def _own_files(folder: str, manifest: dict[str, Any], source: int) -> Optional[list[str]]:
    """The per-process files of saved process ``source``; those it attached to a checkpoint that
    process 0 committed alone (``solo``) join the manifest's list, checked like the rest. None when a
    checkpoint of that kind holds none (saved by process 0 only)."""
    own = [saver.rank_file(source)] + ([saver.grads_file(source)] if manifest["mid_accumulation"] else [])
    if own[0] not in manifest["files"] and solo.TOKEN_KEY in manifest:
        attached = solo.read_attachment(folder, manifest, source)
        if attached is None:
            return None
        manifest["files"].update(attached)
    return own


def _read_states(acc: Any, reader: restorer.Reader, manifest: dict, models: list, allow_pickle: bool,
                 problems: list, own_state: bool = True) -> dict[str, Any]:
    contents = manifest["contents"]
    out: dict[str, Any] = {"models": [], "model_views": [], "optimizers": [], "optimizer_files": [], "schedulers": [],
                           "custom": [], "grads": None}
    if len(contents["models"]) != len(models):
        problems.append(("mismatch", f"it holds {len(contents['models'])} models but {len(models)} are prepared "
                         "(after the load_state pre-hooks)"))
        return out
    inner = [acc.unwrap_model(model, keep_torch_compile=False) for model in models]
    backend = out["sharded"] = backends.reader_for(contents, acc.strategy)
    if hasattr(backend, "read_through"):  # its files come from the verified bytes, never again by path
        backend.read_through(reader)
    live = acc.strategy.checkpoint_backend()
    if getattr(live, "EXCLUSIVE", False) and getattr(backend, "KEY", None) != live.KEY:
        problems.append(("mismatch", f"it was written without {live.NAME} and this run uses {live.NAME}, which "
                         "loads only its own checkpoints; resume with the strategy that wrote it, or load its "
                         "weights with load_checkpoint_in_model before prepare"))
        return out
    if backend is not None:  # DCP shards (any layout) or engine checkpoints: checked against the live objects
        problems.extend(("mismatch", p) for p in backend.check(reader.folder, contents, inner, acc._optimizers))
    for i, (entry, model) in enumerate(zip(contents["models"], inner)):
        if backend is not None:
            out["models"].append(None)
            out["model_views"].append(None)
            continue
        view = reader.view(entry["file"])
        found = restorer.check_model(view, model, i)
        problems.extend(("mismatch", p) for p in found)
        out["models"].append(restorer.model_state(view))
        out["model_views"].append(view)
    for i, (entry, opt) in enumerate(zip(contents["optimizers"], acc._optimizers)):
        out["optimizer_files"].append(entry["file"])
        if backend is not None and backend.KEY in entry:
            out["optimizers"].append(None)
            continue
        state, _ = reader.state(entry["file"])
        state = acc.strategy.saved_optimizer_state(getattr(opt, "optimizer", opt), state)
        problems.extend(("mismatch", p) for p in restorer.check_optimizer(state, opt, i))
        out["optimizers"].append(state)
    out["schedulers"] = [reader.state(e["file"])[0] for e in contents["schedulers"]]
    out["scaler"] = None
    if contents["scaler"] is not None and acc.precision.scaler is not None:
        out["scaler"] = reader.state(contents["scaler"])[0]
    elif contents["scaler"] is not None or acc.precision.scaler is not None:
        warnings.warn("load_state: the checkpoint and this run differ in fp16 gradient scaling; the scaler "
                      + ("state is ignored" if contents["scaler"] else "starts fresh"), HastenWarning, stacklevel=4)
    out["custom"] = [reader.state(e["file"], allow_pickle)[0] for e in contents["custom_objects"]]
    source = resume.saved_rank_for(acc.process_index, int(manifest["world_size"])) if own_state else 0
    rank_state, _ = reader.state(saver.rank_file(source))
    out["rank"] = rank_state
    # Without a state of its own, process 0's position is converted as for another number of processes:
    # only what decides every process's order (epoch, batches, shuffle seeds) is taken from it.
    infos = contents["dataloaders"] if own_state else [dict(i, num_processes=None) for i in contents["dataloaders"]]
    out["dataloaders"] = [
        resume.convert_loader_state(state, info, dl, i, acc.strategy.mesh.dp_size)
        for i, (state, info, dl) in enumerate(zip(rank_state["dataloaders"], infos, acc._dataloaders))
    ]
    if manifest["mid_accumulation"] and own_state:
        view = reader.view(saver.grads_file(source))
        problems.extend(("mismatch", p) for p in restorer.check_gradients(view, acc))
        out["grads"] = view.tensors()
    return out
