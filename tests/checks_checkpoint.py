"""save_state / load_state with 2 processes, run inside each rank (see distributed.py)."""

import json
import os

import torch
from torch import nn

from hasten import Accelerator
from hasten.files.errors import CheckpointCorruptError
from hasten.checkpointing import layout
from hasten.checkpointing.layout import IncompleteCheckpointError, wait_for_deletions
from hasten.saving import CheckpointMismatchError
from hasten.utils import ProjectConfiguration


def _project(name):
    return os.path.join(os.environ["HASTEN_TEST_TMP"], name)


class Counter:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _setup(name, **cfg):
    torch.manual_seed(0)
    acc = Accelerator(project_config=ProjectConfiguration(_project(name), automatic_checkpoint_naming=True, **cfg))
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    model(torch.ones(2, 4, device=acc.device)).sum().backward()
    opt.step()
    opt.zero_grad()
    return acc, model, opt


def _weights(acc, model):
    return {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def check_every_process_writes_only_its_own_files():
    acc, model, opt = _setup("own_files")
    seen = []
    acc.register_save_state_pre_hook(lambda models, weights, folder: seen.append(os.path.basename(folder)))
    folder = acc.save_state()
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    writers = {name: info["rank"] for name, info in manifest["files"].items()}
    return {"writers": writers, "world": manifest["world_size"], "hook_folder": seen[0].split(".tmp-")[0]}


def check_every_process_refuses_a_corrupt_file_of_another():
    acc, model, opt = _setup("corrupt")
    folder = acc.save_state()
    acc.wait_for_everyone()
    if acc.process_index == 1:  # rank 1's own file: only rank 1 reads (and verifies) it
        path = os.path.join(folder, "rank_1.safetensors")
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 1
        open(path, "wb").write(bytes(data))
    acc.wait_for_everyone()
    with torch.no_grad():
        acc.unwrap_model(model).weight.add_(1.0)
    before = _weights(acc, model)
    try:
        acc.load_state(folder, verify="checksum")
    except CheckpointCorruptError as e:
        error = str(e)
    else:
        error = None
    untouched = all(torch.equal(before[k], v) for k, v in _weights(acc, model).items())
    return {"error": error is not None and "rank_1.safetensors' is corrupted" in error, "untouched": untouched}


def check_every_process_refuses_when_one_process_differs():
    acc, model, opt = _setup("differs")
    acc.register_for_checkpointing(Counter(3))
    folder = acc.save_state()
    acc, model, opt = _setup("differs")
    acc.register_for_checkpointing(Counter(0))
    if acc.process_index == 1:
        acc.register_for_checkpointing(Counter(0))  # only on rank 1
    try:
        acc.load_state(folder)
    except CheckpointMismatchError as e:
        return "1 objects given to register_for_checkpointing but this run has 2" in str(e)
    return False


def check_retention_and_numbering():
    acc, model, opt = _setup("retention", total_limit=1)
    names = [os.path.basename(acc.save_state()) for _ in range(3)]
    wait_for_deletions()  # retired checkpoints are deleted in the background
    acc.wait_for_everyone()
    left = sorted(os.listdir(os.path.join(_project("retention"), "checkpoints")))
    return {"names": names, "left": left}


def check_save_on_each_node_on_one_machine():
    acc, model, opt = _setup("each_node", save_on_each_node=True)
    folder = acc.save_state()
    before = _weights(acc, model)
    with torch.no_grad():
        acc.unwrap_model(model).weight.zero_()
    acc.load_state(folder)
    return all(torch.equal(before[k], v) for k, v in _weights(acc, model).items())


def check_a_rank_file_missing_from_the_manifest_is_named():
    acc, model, opt = _setup("no_rank_file")
    folder = acc.save_state()
    acc.wait_for_everyone()
    if acc.process_index == 0:  # a manifest written without rank 1's file (a save that lost a process)
        path = os.path.join(folder, "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        del manifest["files"]["rank_1.safetensors"]
        manifest[layout.CHECKSUM_KEY] = layout.manifest_checksum(manifest)  # as a save that wrote it would
        with open(path, "w") as f:
            json.dump(manifest, f)
    acc.wait_for_everyone()
    try:
        acc.load_state(folder)
    except IncompleteCheckpointError as e:
        return str(e)
    return None


def check_resume_from_a_damaged_manifest_raises_on_every_process():
    acc, model, opt = _setup("damaged_contents")
    folder = acc.save_state()
    acc.wait_for_everyone()
    if acc.process_index == 0:  # only process 0 reads the manifest to decide where to resume from
        path = os.path.join(folder, "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        del manifest["contents"]
        manifest[layout.CHECKSUM_KEY] = layout.manifest_checksum(manifest)  # as a save that wrote it would
        with open(path, "w") as f:
            json.dump(manifest, f)
    acc.wait_for_everyone()
    acc = Accelerator(resume=folder)
    try:
        acc.prepare(nn.Linear(4, 3))
    except ValueError as e:
        return str(e)
    return None


def check_background_saves_share_one_group_released_at_the_end():
    """Accelerators built in a loop reuse one gloo group for their background saves (no threads and
    sockets leaked per Accelerator), and what ends the script destroys it while the interpreter still
    runs: gloo's worker threads that outlive a collective abort the process if they are still there
    when it finalizes."""
    import torch.distributed as dist
    from hasten.checkpointing import commit

    from hasten import group_lifetime

    # The save group is made with the process group (it may already be there): count the others.
    groups_before = len(dist.distributed_c10d._world.pg_map) - len(group_lifetime._SAVE_GROUP)
    used = []
    for i in range(3):
        acc, model, opt = _setup(f"loop{i}")
        acc.save_state(blocking=False)
        used.append(commit.save_group())
        acc.wait_for_checkpoint()
    shared = len({id(g) for g in used}) == 1 and used[0] is not None
    grown = len(dist.distributed_c10d._world.pg_map) - groups_before
    commit.wait_all()
    return {"shared": shared, "grown": grown, "left": len(dist.distributed_c10d._world.pg_map) - groups_before,
            "saved": sorted(os.listdir(os.path.join(_project(f"loop{i}"), "checkpoints")))}
