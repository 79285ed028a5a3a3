"""DCP shard files (``.distcp``) are read through hasten's file layer: a shard replaced, linked to an
outside file or rewritten in place after hasten verified the checkpoint (from a ``load_state`` pre-hook,
or between ``merge-weights``' check and its read) loads the verified values or stops with an error
naming the file, never the tampered values (2 FSDP2 processes in checks_dcp_reading.py)."""

import os
import shutil

import pytest
import torch
from torch import nn

from checks_dcp_reading import tamper as _tamper
from distributed import run_checks

HOWS = ["replaced", "linked", "rewritten"]


def _fill(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).fill_(value)


def _values(model: nn.Module) -> set:
    return {float(v) for p in model.parameters()
            for v in (p.to_local() if hasattr(p, "to_local") else p).detach().flatten().unique()}


@pytest.fixture
def fsdp_saved(tmp_path, one_process_fsdp):
    """One FSDP2 process: ``good`` holds 1.0 everywhere, ``outside.distcp`` the shard of a save holding 666.0."""
    from hasten import Accelerator
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    _fill(model, 666.0)
    evil = acc.save_state(str(tmp_path / "evil"))
    _fill(model, 1.0)
    good = acc.save_state(str(tmp_path / "good"))
    _fill(model, 0.0)
    outside = str(tmp_path / "outside.distcp")
    shutil.copyfile(os.path.join(evil, "sharded", "__0_0.distcp"), outside)
    assert os.path.getsize(outside) == os.path.getsize(os.path.join(good, "sharded", "__0_0.distcp"))
    return acc, model, good, outside


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("verify", ["checksum", "size"])
def test_fsdp_load_state_loads_the_shards_it_verified(fsdp_saved, how, verify):
    acc, model, good, outside = fsdp_saved
    acc.register_load_state_pre_hook(
        lambda models, folder: _tamper(os.path.join(folder, "sharded", "__0_0.distcp"), outside, how))
    try:
        acc.load_state(good, verify=verify)
    except Exception as e:  # noqa: BLE001 - an error is acceptable if it names the file
        assert "__0_0.distcp" in str(e), e
        assert _values(model) <= {0.0, 1.0}, _values(model)  # never a tampered value
        return
    assert _values(model) == {1.0}, f"the model holds bytes that were not verified: {_values(model)}"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("how", HOWS)
def test_merge_weights_reads_the_shards_it_verified(fsdp_saved, tmp_path, monkeypatch, how):
    from safetensors.torch import load_file

    from hasten.commands import merge
    from hasten.commands.merge import HastenCLIError

    acc, model, good, outside = fsdp_saved
    original = merge.read_dcp

    def tampered_then_read(folder, *args, **kwargs):  # after merge verified every file of the manifest
        _tamper(os.path.join(folder, "__0_0.distcp"), outside, how)
        return original(folder, *args, **kwargs)

    monkeypatch.setattr(merge, "read_dcp", tampered_then_read)
    out = str(tmp_path / "merged")
    try:
        merge.merge_weights(good, out)
    except HastenCLIError as e:
        assert "__0_0.distcp" in str(e), e
        return
    tensors = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, name)))
    assert tensors and all(bool((t == 1.0).all()) for t in tensors.values()), "merged bytes that were not verified"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("how", HOWS)
def test_plain_dcp_folder_is_read_once_without_links(tmp_path, fresh_state, how):
    """A DCP folder without a manifest (``load_fsdp_model``, ``merge-weights`` of a DCP folder): a shard
    swapped after hasten validated the folder is refused when it is a link; either way the values read
    are those of one read of a plain file (never two reads of different files)."""
    import torch.distributed.checkpoint as dcp

    from hasten.checkpointing.dcp_reader import MetadataReader, WeightsOnlyPlanner, validate
    from hasten.files.unpickling import dcp_metadata

    folder, evil = str(tmp_path / "dcp"), str(tmp_path / "evil")
    dcp.save({"w": torch.ones(64)}, checkpoint_id=folder, no_dist=True)
    dcp.save({"w": torch.full((64,), 666.0)}, checkpoint_id=evil, no_dist=True)
    metadata = dcp_metadata(os.path.join(folder, ".metadata"))
    validate(folder, metadata)
    shard = next(n for n in os.listdir(folder) if n.endswith(".distcp"))
    _tamper(os.path.join(folder, shard), os.path.join(evil, shard), how)
    state = {"w": torch.zeros(64)}
    if how == "linked":
        with pytest.raises(BaseException, match=shard):
            dcp.load(state, storage_reader=MetadataReader(folder, metadata), planner=WeightsOnlyPlanner(folder),
                     no_dist=True)
        assert bool((state["w"] == 0).all())
    else:  # no manifest records these bytes: what is read is the file found at the one read
        dcp.load(state, storage_reader=MetadataReader(folder, metadata), planner=WeightsOnlyPlanner(folder),
                 no_dist=True)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_checks("checks_dcp_reading", world_size=2, env={"DCP_TMP": str(tmp_path_factory.mktemp("dcp"))})


@pytest.mark.parametrize("case", ["replaced_checksum", "linked_checksum", "rewritten_checksum", "rewritten_size",
                                  "linked_size"])
def test_two_fsdp_processes_load_the_shards_they_verified(two, case):
    two.assert_passed(f"check_{case}")
