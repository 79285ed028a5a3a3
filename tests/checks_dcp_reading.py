"""Two FSDP2 processes (see distributed.py and test_dcp_reading.py): a ``.distcp`` shard replaced,
linked to an outside file, or rewritten in place by a ``load_state`` pre-hook (after hasten verified the
checkpoint, before the shards are read) never reaches the model."""

import os
import shutil

import torch
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin


def _setup():
    reset_state()
    torch.manual_seed(0)
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2))
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _fill(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(value)


def _values(model) -> set:
    return {float(v) for p in model.parameters() for v in p.to_local().detach().flatten().unique()}


def tamper(path: str, evil: str, how: str) -> None:
    """``path`` replaced by a copy of ``evil``, by a link to it, or rewritten in place with its bytes."""
    if how == "replaced":
        shutil.copyfile(evil, path + ".new")
        os.replace(path + ".new", path)
    elif how == "linked":
        os.symlink(evil, path + ".link")
        os.replace(path + ".link", path)
    else:
        with open(evil, "rb") as f:
            data = f.read()
        with open(path, "r+b") as f:
            f.write(data)


def _case(how: str, verify: str) -> dict:
    root = os.environ["DCP_TMP"]
    acc, model, opt = _setup()
    base = os.path.join(root, f"{how}-{verify}")
    _fill(model, 666.0)
    evil = acc.save_state(base + "-evil")
    _fill(model, 1.0)
    good = acc.save_state(base + "-good")
    _fill(model, 0.0)
    outside = os.path.join(root, f"{how}-{verify}-outside.distcp")
    if acc.is_main_process:
        shutil.copyfile(os.path.join(evil, "sharded", "__1_0.distcp"), outside)
    acc.wait_for_everyone()

    def hook(models, folder):
        if acc.is_main_process:  # the shard the other process reads
            tamper(os.path.join(folder, "sharded", "__1_0.distcp"), outside, how)
        acc.wait_for_everyone()

    acc.register_load_state_pre_hook(hook)
    try:
        acc.load_state(good, verify=verify)
    except Exception as e:  # noqa: BLE001 - an error naming the file is acceptable
        assert "__1_0.distcp" in str(e), e
        # DCP reads into the live shards: a process whose own shards were intact may hold them (verified)
        assert _values(model) <= {0.0, 1.0}, _values(model)
        return {"error": str(e)[:300]}
    assert _values(model) == {1.0}, f"the model holds bytes that were not verified: {_values(model)}"
    return {"loaded": True}


def check_replaced_checksum():
    return _case("replaced", "checksum")


def check_linked_checksum():
    return _case("linked", "checksum")


def check_rewritten_checksum():
    return _case("rewritten", "checksum")


def check_rewritten_size():
    return _case("rewritten", "size")


def check_linked_size():
    return _case("linked", "size")
