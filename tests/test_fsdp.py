"""FSDP2 on 2 real processes over gloo (checks in checks_fsdp.py), plus single-process pieces."""

import os

import pytest
import torch

from distributed import one_process_checkpoint, run_checks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def single_checkpoint(tmp_path_factory):
    """A checkpoint written by one process (plain model), for the 1 -> 2 load."""
    import checks_fsdp

    folder = str(tmp_path_factory.mktemp("single") / "ckpt")
    return one_process_checkpoint(folder, checks_fsdp._model(), checks_fsdp.FEATURES)


@pytest.fixture(scope="module")
def two(tmp_path_factory, single_checkpoint):
    tmp = str(tmp_path_factory.mktemp("fsdp"))
    report = run_checks("checks_fsdp", world_size=2, env={"FSDP_TMP": tmp, "FSDP_SINGLE_CKPT": single_checkpoint[0]})
    report.tmp = tmp
    return report


def test_two_processes_equal_one_process_on_twice_the_batch(two):
    for r in two.assert_passed("check_equivalence_plain"):
        assert r["worst"] < 1e-5


def test_equivalence_with_accumulation_and_clipping(two):
    values = two.assert_passed("check_equivalence_accumulation_clipping")
    assert values[0]["norms"] == values[1]["norms"] and len(values[0]["norms"]) == 4


def test_bf16_trains_with_activation_checkpointing(two):
    two.assert_passed("check_bf16_trains")


def test_transformers_model_wrapped_by_layer(two):
    two.assert_passed("check_transformers_layer_wrap")


def test_bitwise_resume_and_manifest_layout(two):
    r = two.assert_passed("check_bitwise_resume")[0]
    assert r["layout"] == {"strategy": "FSDP2Strategy", "state_dict": "dcp",
                           "mesh": {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}}
    assert r["metadata_reads"] == 1  # checked, then loaded, from one read of DCP's .metadata
    assert r["pickle_reads"] == 0  # with hasten's allow-list, never with DCP's pickle.load


def test_ddp_checkpoint_loads_into_fsdp(two):
    two.assert_passed("check_ddp_checkpoint_into_fsdp")


def test_fsdp_checkpoint_loads_into_ddp(two):
    rest = two.assert_passed("check_fsdp_checkpoint_into_ddp")
    saved = two.assert_passed("check_bitwise_resume")[0]["saved_losses"]
    assert max(abs(a - b) for a, b in zip(rest[0], saved)) < 1e-5


def test_single_process_checkpoint_loads_into_fsdp(two, single_checkpoint):
    expected = single_checkpoint[1]
    for got in two.assert_passed("check_single_process_checkpoint_into_fsdp"):
        assert set(got) == set(expected)
        for k in expected:
            assert torch.equal(torch.tensor(got[k]), torch.tensor(expected[k]))


def test_fsdp_checkpoint_loads_into_one_process(two, fresh_state):
    """FSDP2 on 2 processes -> a plain model on 1 process (DCP reshards), bitwise."""
    import checks_fsdp

    from hasten import Accelerator

    at_save = two.assert_passed("check_bitwise_resume")[0]["at_save"]
    acc = Accelerator()
    model = checks_fsdp._model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(checks_fsdp._data(), batch_size=3, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    with pytest.warns(UserWarning, match="saved by 2 processes"):
        acc.load_state(os.path.join(two.tmp, "resume"), continue_dataloaders=True)
    assert len(opt.state) == 6  # Adam moments came along
    got = model.state_dict()
    assert all(torch.equal(got[k].cpu(), torch.tensor(at_save[k])) for k in at_save)  # the model may be on a GPU
    checks_fsdp._run(acc, model, opt, checks_fsdp._batches(loader), 3)  # and it trains on


def test_layout_that_cannot_convert_fails_before_any_change(two):
    two.assert_passed("check_layout_mismatch_changes_nothing")


def test_cpu_ram_efficient_loading_gives_rank0_weights_everywhere(two):
    two.assert_passed("check_cpu_ram_efficient_loading")


def test_optimizer_over_parameters_of_no_prepared_model(two):
    two.assert_passed("check_optimizer_of_unprepared_model")


def test_model_sharded_by_the_user_is_accepted(two):
    assert two.assert_passed("check_user_sharded_model_accepted") == ["dcp", "dcp"]


def test_save_model_writes_consolidated_safetensors(two):
    names = two.assert_passed("check_save_model_streams_full_weights")[0]
    assert "model.safetensors.index.json" in names and len(names) > 2


def test_fp16_overflow_on_one_process_skips_the_step_everywhere_and_the_scaler_resumes(two):
    r = two.assert_passed("check_fp16_overflow_on_one_process_skips_everywhere")
    for key in ("skipped", "changed", "lr_moved", "scale"):  # every process took the same decisions
        assert [s[key] for s in r[0]["steps"]] == [s[key] for s in r[1]["steps"]], key
    assert r[0]["scaler"] == r[1]["scaler"] and r[0]["scaler"]["scale"] == 256.0


def test_device_mesh_and_ranks_match_accelerate(two):
    for rank, facts in enumerate(two.assert_passed("check_device_mesh_and_ranks")):
        assert facts["names"] == ["dp_shard"] and facts["shape"] == [2]
        assert facts["flat"] == {"dp": [2, rank], "dp_shard_cp": [2, rank], "dp_cp": [2, rank]}
        assert facts["ranks"] == {"dp_replicate": 0, "dp_shard": rank, "tp": 0, "cp": 0}
        assert facts["local"] == {"dp_shard": rank}


def test_replicate_under_fsdp_holds_full_parameters_and_matches_ddp(two):
    for r in two.assert_passed("check_replicate_holds_full_parameters"):
        assert r["worst"] < 1e-5 and r["chunks"] == 6  # 3 linears x (weight, bias), each stored whole once


def test_cpu_ram_efficient_loading_with_offload_keeps_cpu_shards(two):
    two.assert_passed("check_cpu_ram_efficient_loading_with_offload")


# -- the plugin (no processes) ---------------------------------------------------------------------
def test_plugin_reads_fsdp_environment(monkeypatch):
    from hasten import FullyShardedDataParallelPlugin

    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Block,Other")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    p = FullyShardedDataParallelPlugin()
    assert (p.fsdp_version, p.auto_wrap_policy, p.transformer_cls_names_to_wrap, p.cpu_offload,
            p.reshard_after_forward) == (2, "TRANSFORMER_BASED_WRAP", ["Block", "Other"], True, False)


def test_plugin_translates_fsdp1_settings_with_one_note():
    from hasten import FullyShardedDataParallelPlugin

    with pytest.warns(UserWarning, match="translated to FSDP2") as caught:
        p = FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="SHARD_GRAD_OP",
                                           backward_prefetch="BACKWARD_PRE", use_orig_params=True)
    assert len(caught) == 1 and p.fsdp_version == 2 and p.reshard_after_forward is False


@pytest.mark.parametrize("kwargs, named", [
    (dict(fsdp_version=1, sharding_strategy="HYBRID_SHARD"), "sharding_strategy='HYBRID_SHARD'"),
    (dict(fsdp_version=1, backward_prefetch="BACKWARD_POST"), "backward_prefetch='BACKWARD_POST'"),
    (dict(fsdp_version=1, forward_prefetch=True), "forward_prefetch=True"),
    (dict(fsdp_version=3), "fsdp_version=3"),
    (dict(fsdp_version=2, auto_wrap_policy="EVERYTHING"), "auto_wrap_policy='EVERYTHING'"),
    (dict(fsdp_version=2, state_dict_type="LOCAL_STATE_DICT"), "state_dict_type='LOCAL_STATE_DICT'"),
    (dict(fsdp_version=2, min_num_params="many"), "min_num_params='many'"),
    (dict(fsdp_version=2, reshard_after_forward="sometimes"), "reshard_after_forward='sometimes'"),
])
def test_plugin_bad_values_are_named(kwargs, named):
    from hasten import FullyShardedDataParallelPlugin

    with pytest.raises(ValueError) as info:
        FullyShardedDataParallelPlugin(**kwargs)
    assert named in str(info.value)


def test_tampered_metadata_runs_nothing_and_shards_are_checksummed(two):
    """Issue #18 item 1: DCP's .metadata is read with an allow-list, sharded files carry checksums."""
    values = two.assert_passed("check_tampered_or_damaged_shards_are_refused")
    assert values[0]["refused"] == values[1]["refused"]  # one message, raised on every process


@pytest.mark.parametrize("given, kind", [
    ("sharded_state_dict", "SHARDED_STATE_DICT"),
    ("3", "SHARDED_STATE_DICT"),  # Accelerate's config files may hold the enum's number
    ("1", "FULL_STATE_DICT"),
])
def test_plugin_state_dict_type_as_accelerate_accepts_it(given, kind):
    from hasten import FullyShardedDataParallelPlugin

    assert FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=given).state_dict_type == kind


def test_plugin_takes_torchs_state_dict_type_enum():
    # Accelerate's own merge-weights script passes torch's enum, not a string.
    from torch.distributed.fsdp import StateDictType

    from hasten import FullyShardedDataParallelPlugin

    for member, kind in ((StateDictType.SHARDED_STATE_DICT, "SHARDED_STATE_DICT"),
                         (StateDictType.FULL_STATE_DICT, "FULL_STATE_DICT")):
        assert FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=member).state_dict_type == kind
    with pytest.raises(ValueError, match="state_dict_type='LOCAL_STATE_DICT'"):
        FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=StateDictType.LOCAL_STATE_DICT)


def test_plugin_set_auto_wrap_policy_checks_the_model_as_accelerate_does():
    # Accelerate's scripts call plugin.set_auto_wrap_policy(model) before prepare.
    from hasten import FullyShardedDataParallelPlugin

    class Block(torch.nn.Linear):
        pass

    class Net(torch.nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(2, 2), Block(2, 2)])

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    plugin.set_auto_wrap_policy(Net())
    assert plugin.transformer_cls_names_to_wrap == ["Block"] and plugin.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    missing = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                             transformer_cls_names_to_wrap=["Decoder"])
    with pytest.raises(ValueError, match="'Decoder'"):
        missing.set_auto_wrap_policy(Net())
    size = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=10)
    size.set_auto_wrap_policy(Net())
    assert size.auto_wrap_policy == "SIZE_BASED_WRAP" and size.min_num_params == 10
