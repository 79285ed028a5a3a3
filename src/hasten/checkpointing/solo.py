"""``save_state`` called by one process only, and the bounded arrival check of collective saves.

Scripts written for Accelerate often save under ``if accelerator.is_main_process:`` (diffusers'
training examples do). Where the state is not sharded (one process, DDP: the strategy's
``checkpoint_format`` is ``"full"``) and the caller names the folder, a save therefore involves no
collective, as in Accelerate, and no process ever waits for one that may not come:

- Process 0 writes the shared files and its own per-process files into the temporary folder and
  commits it alone (fsyncs, manifest with checksums, atomic rename: ``commit.commit_alone``). With
  several processes its manifest carries ``attach_token``: the other processes' per-process files
  are not in it, they come as attachments. It then posts the outcome (folder and token, or its
  error) in the process group's key-value store, without waiting for anyone.
- Any other process that calls ``save_state`` does so in the every-process pattern, where process 0
  calls too: it records its own state at the moment of the call (save hooks, then its generators,
  its dataloader positions, partial gradients), reads process 0's outcome from the store (waiting
  up to the process group's timeout), and adds its files to the committed folder: each written
  under a temporary name, fsynced and renamed, then ``attached_rank_<r>.json`` last (their sizes and
  checksums, the save's token, its own checksum), atomically.

``read_attachment`` is the load side: an attachment is verified like a manifest (it must be a real
file, its own checksum, the token of this checkpoint, names inside the folder that the manifest does
not list); its files are then verified by size and checksum like every other file. A process whose
attachment is missing (a save made by process 0 only, as Accelerate writes only
``random_states_0.pkl`` then) resumes with its generators as they are and process 0's dataloader
position, with a warning.

Matching a process's call with process 0's: both compute the same key from what processes in step
share (the default group's count of collectives, the optimizer steps taken, and how many saves
they made since those last changed).

Sharded states, automatic naming and ``save_on_each_node`` on several machines keep the collective
protocol (``commit.write_and_commit``); ``check_arrival`` runs before its first collective, so a
call made by one process there is one clear error after a bounded wait, not a hang.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any, Optional

from .. import progress
from ..files.paths import why_outside
from ..files.durable import fsync_path
from . import commit, layout, rng, saver
from ..files.errors import CheckpointCorruptError
from ..files.reading import file_checksum

ATTACHMENT_FORMAT = "hasten-attachment"
TOKEN_KEY = "attach_token"
_PREFIX = "hasten/save_state"


def attachment_name(rank: int) -> str:
    return f"attached_rank_{rank}.json"


class _Clock:
    """The key of a save, the same on processes that are in step (see the module docstring)."""

    def __init__(self) -> None:
        self.last: Optional[tuple] = None
        self.count = 0

    def key(self, kind: str) -> str:
        now = (_collectives(), progress.STATE.steps)
        self.count = self.count + 1 if now == self.last else 0
        self.last = now
        return f"{_PREFIX}/{kind}/{now[0]}.{now[1]}.{self.count}"


def _collectives() -> int:
    """How many collectives this process issued on the default group (-1 where torch does not say)."""
    import torch.distributed as dist

    try:
        return int(dist.group.WORLD._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return -1


CLOCK = _Clock()  # one per process: the store and the default group are the process's too


def store() -> Any:
    """The default process group's key-value store; None on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def group_timeout() -> float:
    """Seconds a collective of the default group may wait (the user's process-group timeout)."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    from ..group_lifetime import _timeout_of

    timeout = _timeout_of(dist.group.WORLD) or default_pg_timeout
    return timeout.total_seconds()


def arrival_bound() -> tuple[float, str]:
    """How long a collective save waits for every process to call it, and why that long.

    The smaller of the hang timeout (``InitProcessGroupKwargs(hang_timeout=)``, else ``hasten
    launch``'s ``HASTEN_HANG_TIMEOUT``; 0 turns it off) and the process group's timeout: a process
    that needs longer to arrive would have stopped the job anyway (the launcher stops a job without
    progress after the hang timeout; the first collective of the save fails after the group's).
    """
    group = group_timeout()
    hang = progress.STATE.hang_timeout
    source = "the hang timeout"
    if hang is None:
        raw = os.environ.get("HASTEN_HANG_TIMEOUT")
        try:
            hang = float(raw) if raw else None
        except ValueError:
            hang = None
        source = "HASTEN_HANG_TIMEOUT"
    if hang and 0 < hang < group:
        return hang, source
    return group, "the process group's timeout"


def check_arrival(rank: int, world: int, cause: str) -> None:
    """Before the first collective of a collective save: wait (bounded, ``arrival_bound``) until every
    process has called ``save_state``; otherwise raise one clear error instead of hanging."""
    kv = store()
    if kv is None:
        return
    key = CLOCK.key("arrive")
    mine = f"{key}/{rank}"
    kv.set(mine, "1")
    bound, source = arrival_bound()
    try:
        kv.wait([f"{key}/{r}" for r in range(world)], timedelta(seconds=bound))
        return
    except Exception:  # noqa: BLE001 - torch's store timeout (DistStoreError, RuntimeError in older torch)
        pass
    absent = [r for r in range(world) if not kv.check([f"{key}/{r}"])]
    try:
        kv.delete_key(mine)  # a process arriving later learns nothing from a save given up
    except Exception:  # noqa: BLE001 - not every store deletes keys
        pass
    if not absent:  # everyone arrived just as the wait ended
        return
    who = ", ".join(map(str, absent))
    raise RuntimeError(
        f"save_state on process {rank}: process {who} did not call save_state within {bound:g} s ({source}); "
        f"{cause}, so every process takes part in the save. Call accelerator.save_state(...) on every process "
        "(not under `if accelerator.is_main_process:`); nothing was written"
    )


def collective_cause(acc: Any) -> Optional[str]:
    """Why a save of ``acc`` needs every process (None: process 0 can save alone)."""
    pc = acc.project_configuration
    kind = getattr(acc.strategy, "checkpoint_format", "full")
    if kind == "deepspeed":
        return "this run's state is sharded by DeepSpeed (every process writes its own engine files)"
    if kind != "full":
        return ("this run's state is sharded (FSDP2, tensor parallelism, pipeline stages or a model you sharded: every process "
                "writes its own shards)")
    if pc.automatic_checkpoint_naming:
        return ("ProjectConfiguration(automatic_checkpoint_naming=True) numbers the checkpoint with every "
                "process (as Accelerate, whose save_state waits for every process there)")
    if pc.save_on_each_node and acc.state.num_machines > 1:
        return "save_on_each_node on several machines writes one folder per machine"
    return None


# -- process 0 --------------------------------------------------------------------------------------------
def post(kv: Any, key: Optional[str], **record: Any) -> None:
    """Post process 0's outcome of a save for the other processes (never waits)."""
    if kv is not None and key is not None:
        kv.set(key, json.dumps(record))


def save_as_main(acc: Any, output_dir: Any, background: Any) -> str:
    """Process 0's part (or the only process's): the whole save, committed without waiting for anyone."""
    kv = store()
    key = CLOCK.key("solo") if kv is not None else None
    folder = None
    try:
        choice = acc._choose_target(output_dir)
        if isinstance(choice, str):
            raise ValueError(choice)
        target, number, token = choice
        folder = layout.temp_path(target, token)
        os.makedirs(folder, exist_ok=True)
        mid_window = acc._mid_window()
        contents = acc._contents(True)
        models = list(acc._models)
        weights = [acc.get_state_dict(model) for model in models]
        acc._checkpoints.save_pre_hooks.run(models, weights, folder)
        rng_state = rng.capture()  # after the hooks, as Accelerate records them
        items = acc._own_items(models, weights, contents, rng_state, True, None, mid_window)
        head = acc._manifest_head(number, mid_window, contents)
        if kv is not None:
            head[TOKEN_KEY] = token  # the other processes' own files come as attachments
        job = commit.SaveJob(folder, target, token, number, acc.process_index, acc.num_processes, 0, True, head,
                             acc.project_configuration.total_limit)
        if background is not None:
            items = background.stager.stage(items)
    except Exception as e:
        if folder is not None:
            layout.remove_tree(folder)
        post(kv, key, error=f"save_state failed on process 0; nothing was committed: {type(e).__name__}: {e}")
        raise

    def work() -> None:
        try:
            commit.commit_alone(job, items)
        except BaseException as e:
            post(kv, key, error=str(e))
            raise
        post(kv, key, target=target, token=token)

    if background is None:
        work()
    else:
        background.start(target, work)
    return target


# -- the other processes ----------------------------------------------------------------------------------
def save_as_other(acc: Any, output_dir: Any, background: Any) -> str:
    """Another process's part: its own state now, added to process 0's checkpoint once committed."""
    kv = store()
    key = CLOCK.key("solo")
    rank = acc.process_index
    mid_window = acc._mid_window()
    models = list(acc._models)
    hooks = acc._checkpoints.save_pre_hooks
    hook_folder = None
    if hooks.hooks:  # as in Accelerate every process runs them; what they write joins the checkpoint
        hook_folder = hook_folder_for(output_dir, layout.new_token())
        os.makedirs(hook_folder, exist_ok=True)
        try:
            hooks.run(models, [acc.get_state_dict(model) for model in models], hook_folder)
        except BaseException:
            layout.remove_tree(hook_folder)
            raise
    rng_state = rng.capture()  # after the hooks, as Accelerate records them
    items = saver.process_items(acc, rng_state, mid_window)
    if background is not None:
        items = background.stager.stage(items)
    found: list = []

    def work() -> None:
        try:
            record = wait_for_main(kv, key, rank)
        except BaseException:
            if hook_folder is not None:
                layout.remove_tree(hook_folder)
            raise
        attach(record["target"], record["token"], rank, items, hook_folder)
        found.append(record["target"])

    if background is None:
        work()
        return found[0]
    own = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
    background.start(own, work)
    return own  # process 0 names the folder; known once it has committed


def wait_for_main(kv: Any, key: str, rank: int) -> dict[str, Any]:
    """Process 0's outcome of the save this process takes part in; raises its error, or a clear one
    when it does not come within the process group's timeout."""
    bound = group_timeout()
    try:
        kv.wait([key], timedelta(seconds=bound))
        record = json.loads(kv.get(key))
    except Exception:  # noqa: BLE001 - torch's store timeout
        raise RuntimeError(
            f"save_state on process {rank}: process 0 did not finish a save_state of its own within {bound:g} s "
            "(the process group's timeout), so this process's own state (random generators, dataloader "
            "positions, partial gradients) was not added to any checkpoint. Call save_state on every process at "
            "the same point of the loop, or on process 0 only"
        ) from None
    if record.get("error"):
        raise RuntimeError(record["error"])
    return record


def attach(target: str, token: str, rank: int, items: list, hook_folder: Optional[str]) -> None:
    """Add this process's files (``items``, and the files its save hooks wrote into ``hook_folder``)
    to the checkpoint process 0 committed at ``target`` for the save ``token``."""
    manifest = _manifest_of(target)
    if manifest.get(TOKEN_KEY) != token:
        raise RuntimeError(
            f"save_state on process {rank}: the checkpoint {target!r} was replaced before this process could add "
            "its own files to it (another save_state to the same folder?); they are not saved"
        )
    mine = layout.new_token()
    staging = os.path.join(target, f".attach-{rank}-{mine}")  # beside the files, on the same filesystem
    os.makedirs(staging)
    try:
        writer = saver.Writer(staging, rank)
        for item in items:
            writer.write(item)
        files = dict(writer.files)
        moves = [(os.path.join(staging, name), name) for name in files]
        if hook_folder is not None:
            commit.copy_links(hook_folder)  # a linked file is stored as a copy of its bytes
            for name in layout.files_in(hook_folder):
                if (name in manifest["files"] or name in files or name.startswith("attached_rank_")
                        or os.path.lexists(os.path.join(target, name))):
                    continue  # process 0's copy of the file is the checkpoint's; the record's names are taken
                source = os.path.join(hook_folder, name)
                fsync_path(source)
                files[name] = {"size": os.path.getsize(source), "checksum": file_checksum(source), "rank": "hook"}
                moves.append((source, name))
        folders = set()
        for source, name in moves:
            parent = os.path.dirname(os.path.join(target, name))
            if parent != target:
                os.makedirs(parent, exist_ok=True)
                folders.add(parent)
            os.replace(source, os.path.join(target, name))
        for folder in folders:
            fsync_path(folder)
        record = {"format": ATTACHMENT_FORMAT, "format_version": 1, "rank": rank, TOKEN_KEY: token, "files": files}
        name = attachment_name(rank)
        layout.write_manifest(staging, record, name)  # with its own checksum, fsynced
        os.replace(os.path.join(staging, name), os.path.join(target, name))  # last: the files it lists are in place
        fsync_path(target)
    finally:
        layout.remove_tree(staging)
        if hook_folder is not None:
            layout.remove_tree(hook_folder)


def _manifest_of(target: str) -> dict[str, Any]:
    try:
        manifest = json.loads(layout._read_text(target))  # never through a link
    except (OSError, ValueError) as e:
        raise RuntimeError(f"save_state: the checkpoint {target!r} that process 0 committed cannot be read "
                           f"({type(e).__name__}: {e})") from None
    return manifest if isinstance(manifest, dict) else {}


def hook_folder_for(output_dir: Any, token: str) -> str:
    """The folder this process's save hooks write into (moved into the checkpoint by ``attach``): beside
    the folder it asked for, hidden, and named so that no commit's cleaning takes it for its leftover."""
    own = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
    return os.path.join(os.path.dirname(own), f".{os.path.basename(own)}.hooks-{token}")


# -- load -------------------------------------------------------------------------------------------------
def read_attachment(folder: str, manifest: dict[str, Any], rank: int) -> Optional[dict[str, Any]]:
    """The files process ``rank`` attached to a checkpoint committed by process 0 alone (their manifest
    records: size, checksum); None when it attached none. Raises ``CheckpointCorruptError`` naming the
    attachment when it is damaged, crafted, or belongs to another save."""
    name = attachment_name(rank)
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    try:
        record = json.loads(layout._read_text(folder, name))  # a plain file inside the folder, never a link
    except layout.UnsafeFileError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{path!r} is damaged: it cannot be read as JSON ({type(e).__name__}: {e})"
                                     ) from None
    problem = _attachment_problem(folder, manifest, record, rank)
    if problem:
        raise CheckpointCorruptError(f"{path!r} is damaged or crafted: {problem}; the checkpoint cannot be trusted "
                                     "for this process (nothing was changed)")
    return record["files"]


def _attachment_problem(folder: str, manifest: dict[str, Any], record: Any, rank: int) -> Optional[str]:
    if not isinstance(record, dict) or record.get("format") != ATTACHMENT_FORMAT:
        return "it is not a hasten attachment"
    try:
        found = layout.manifest_checksum(record)
    except (TypeError, ValueError):
        found = None
    if record.get(layout.CHECKSUM_KEY) != found:
        return f"its checksum {record.get(layout.CHECKSUM_KEY)!r} does not match its content ({found})"
    if record.get("rank") != rank:
        return f"it is process {record.get('rank')!r}'s, not process {rank}'s"
    if record.get(TOKEN_KEY) != manifest.get(TOKEN_KEY):
        return "it belongs to another save (its token is not this checkpoint's)"
    files = record.get("files")
    if not isinstance(files, dict) or saver.rank_file(rank) not in files:
        return f"it does not list {saver.rank_file(rank)}"
    for entry, info in files.items():
        if entry in manifest["files"] or entry == layout.MANIFEST or entry.startswith("attached_rank_"):
            return f"it lists {entry!r}, which is the checkpoint's own"
        why = why_outside(folder, entry)
        if why:
            return f"it names {entry!r} ({why})"
        if not (isinstance(info, dict) and type(info.get("size")) is int and isinstance(info.get("checksum"), str)):
            return f"no size or checksum for {entry!r}"
    return None


def missing_note(folder: str, rank: int, mid_window: bool) -> str:
    """The warning of a process that resumes without its own per-process state (Accelerate: "Could not
    load random states", then it goes on)."""
    grads = (" Its partial gradients of the accumulation window were not saved either: the first optimizer step "
             "after resuming differs from the uninterrupted run's.") if mid_window else ""
    return (f"checkpoint {folder!r} holds no state of process {rank} (save_state was called by process 0 only, "
            f"or process {rank} could not add its files): its random generators stay as they are and its "
            f"dataloaders continue from process 0's position.{grads} Call save_state on every process for an exact "
            "resume")

