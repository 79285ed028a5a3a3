"""Accelerate's behaviour where its own core tests (accelerator, data loader, logging, utils, tracking)
found hasten different in ways a migrating user meets (issue 26, item 2).

Each test states the behaviour itself; none needs Accelerate or its test files.
"""

from __future__ import annotations

import inspect
import logging
import os
import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from hasten.data_loader import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    SeedableRandomSampler,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)


# -- BatchSamplerShard(even_batches=False) on data smaller than one step ------------------------------------
@pytest.mark.parametrize("split, batch_size", [(False, 3), (True, 4)])
def test_uneven_shard_of_tiny_data_gives_the_extra_rank_nothing(split: bool, batch_size: int) -> None:
    batches = BatchSampler(range(2), batch_size, drop_last=False)
    shards = [BatchSamplerShard(batches, 2, rank, split_batches=split, even_batches=False) for rank in range(2)]
    assert [list(s) for s in shards] == [[[0, 1]], []]  # no sample repeated
    if not split:
        assert [len(s) for s in shards] == [1, 0]
    dropped = BatchSampler(range(2), batch_size, drop_last=True)
    assert [list(BatchSamplerShard(dropped, 2, r, split_batches=split, even_batches=False)) for r in range(2)] == [[], []]


def test_prepared_loader_still_pads_the_lone_step_for_its_collectives() -> None:
    # A deliberate difference from Accelerate, kept: a prepared loader gives every rank a batch (the
    # padding that gather_for_metrics drops), so a loop with a collective per batch cannot hang.
    loaders = [prepare_data_loader(DataLoader(list(range(2)), batch_size=3), num_processes=2, process_index=r,
                                   even_batches=False, put_on_device=False) for r in range(2)]
    assert [[b.tolist() for b in dl] for dl in loaders] == [[[0, 1]], [[0, 1, 0]]]


# -- loaders built by hand ---------------------------------------------------------------------------------
class EpochBatchSampler(BatchSampler):
    """A custom batch sampler whose order depends on its epoch (as the user's may)."""

    def __init__(self, sampler, batch_size: int) -> None:
        super().__init__(sampler, batch_size, drop_last=False)
        self.generator = torch.Generator()
        self.epoch = 0

    def __iter__(self):
        self.generator.manual_seed(1000 + self.epoch)
        order = torch.randperm(len(self.sampler), generator=self.generator).tolist()
        return iter([order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


@pytest.mark.parametrize("loader_class", [DataLoaderShard, DataLoaderDispatcher])
def test_skip_first_batches_keeps_a_hand_built_loaders_batch_sampler_and_epoch(loader_class) -> None:
    data = list(range(16))
    sampler = SeedableRandomSampler(data)
    loader = loader_class(data, batch_sampler=EpochBatchSampler(sampler, 4))
    loader.set_epoch(1)
    reference = EpochBatchSampler(sampler, 4)
    reference.set_epoch(1)
    expected = list(reference)[2:]
    skipped = skip_first_batches(loader, num_batches=2)
    assert [b.tolist() for b in skipped] == expected
    assert sampler.epoch == 1


def test_skip_first_batches_keeps_a_hand_built_loaders_sampler() -> None:
    data = list(range(12))
    sampler = SeedableRandomSampler(data, data_seed=7)
    loader = DataLoaderShard(data, sampler=sampler, batch_size=3)
    loader.set_epoch(2)
    order = list(sampler)  # epoch 2's order
    skipped = skip_first_batches(loader, num_batches=1)
    assert [b.tolist() for b in skipped] == [order[i:i + 3] for i in range(3, 12, 3)]


def test_base_dataloader_is_the_loader_itself_and_exists_on_instances_only() -> None:
    for loader in (SkipDataLoader(range(16), batch_size=4, skip_batches=2), DataLoaderShard(range(16), batch_size=4),
                   DataLoaderDispatcher(range(16), batch_size=4)):
        assert loader.base_dataloader is loader and isinstance(loader.base_dataloader, DataLoader)
    with pytest.raises(AttributeError):
        DataLoaderShard.base_dataloader  # noqa: B018 - the read is the test


# -- the Accelerator and its state ---------------------------------------------------------------------------
def test_prepared_objects_carry_the_prepared_flag(fresh_state) -> None:
    from hasten import Accelerator

    acc = Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(list(range(8)), batch_size=2)
    other = [1, 2, 3]
    prepared = acc.prepare(model, optimizer, scheduler, loader, other)
    assert [getattr(obj, "_is_hasten_prepared", False) for obj in prepared[:4]] == [True] * 4
    assert prepared[4] is other and not hasattr(other, "_is_hasten_prepared")


def test_torch_device_from_the_environment_keeps_its_index(fresh_state, monkeypatch) -> None:
    from distributed import reset_state

    from hasten.state import PartialState

    # CPU on purpose: any index names the one CPU device, so the check runs on every machine.
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu:64")  # cpu-on-purpose
    assert str(PartialState().device) == "cpu:64"
    reset_state()
    monkeypatch.setenv("HASTEN_TORCH_DEVICE", "no-such-device")  # hasten's name wins over Accelerate's
    with pytest.raises(ValueError, match="HASTEN_TORCH_DEVICE / ACCELERATE_TORCH_DEVICE='no-such-device' is not"):
        PartialState()


def test_accelerator_state_names_itself_in_attribute_errors(fresh_state) -> None:
    from hasten import Accelerator

    acc = Accelerator()
    with pytest.raises(AttributeError, match="'AcceleratorState' object has no attribute 'someotherthing'"):
        acc.state.someotherthing  # noqa: B018 - the read is the test
    acc.state.someotherthing = "value"  # a user's own attribute still works
    assert acc.state.someotherthing == "value"


# -- logging -------------------------------------------------------------------------------------------------
class CallerOfCaller(logging.LoggerAdapter):
    """A user's wrapper that asks for the record to name the line that called the wrapper."""

    def log(self, level, msg, *args, **kwargs):
        kwargs["stacklevel"] = 3
        self.logger.log(level, msg, *args, **kwargs)


def test_logger_passes_a_given_stacklevel_on_unchanged(fresh_state, caplog) -> None:
    from hasten import PartialState
    from hasten.logging import get_logger

    PartialState()
    wrapped = CallerOfCaller(get_logger(__name__), {})
    line = inspect.currentframe().f_lineno + 1
    wrapped.warning("through a wrapper")
    plain = get_logger(__name__)
    plain_line = inspect.currentframe().f_lineno + 1
    plain.warning_once("once")
    records = [r for r in caplog.records if r.name == __name__]
    assert [(r.filename, r.lineno, r.funcName) for r in records] == [
        (os.path.basename(__file__), line, "test_logger_passes_a_given_stacklevel_on_unchanged"),
        (os.path.basename(__file__), plain_line, "test_logger_passes_a_given_stacklevel_on_unchanged")]


# -- utils ---------------------------------------------------------------------------------------------------
def test_starting_batch_size_zero_fails_at_the_call_as_a_runtime_error() -> None:
    from hasten.utils import find_executable_batch_size

    calls = []
    decorated = find_executable_batch_size(starting_batch_size=0)(lambda batch_size: calls.append(batch_size))
    with pytest.raises(RuntimeError, match="reached zero"):
        decorated()
    assert calls == []
    with pytest.raises(ValueError, match="starting_batch_size=-1"):
        find_executable_batch_size(starting_batch_size=-1)(lambda batch_size: None)


def test_pad_across_processes_warns_about_nested_tensors_on_one_process_too(fresh_state) -> None:
    from hasten.utils import CannotPadNestedTensorWarning, pad_across_processes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype warning about nested tensors
        nested = torch.nested.nested_tensor([[1, 2, 3], [1]])
    with pytest.warns(CannotPadNestedTensorWarning):
        assert pad_across_processes(nested) is nested
    with pytest.warns(CannotPadNestedTensorWarning):
        pad_across_processes({"ids": [nested]})
    with warnings.catch_warnings():
        warnings.simplefilter("error", CannotPadNestedTensorWarning)
        plain = torch.ones(2, 3)
        assert pad_across_processes(plain) is plain


def test_convert_dict_to_env_variables_lives_in_utils_environment(caplog) -> None:
    import hasten.utils
    from hasten.utils.environment import convert_dict_to_env_variables

    assert hasten.utils.convert_dict_to_env_variables is convert_dict_to_env_variables
    with caplog.at_level(logging.WARNING, logger="hasten.utils.environment"):
        lines = convert_dict_to_env_variables({"HASTEN_DEBUG": "1", "BAD": "<x", "OTHER": "2"})
    assert lines == ["HASTEN_DEBUG=1\n", "OTHER=2\n"]
    assert [r.name for r in caplog.records] == ["hasten.utils.environment"] and "BAD" in caplog.records[0].getMessage()


def test_old_kernel_warning_names_the_version_in_its_message(monkeypatch, caplog) -> None:
    import platform
    from types import SimpleNamespace

    from hasten.utils import check_os_kernel

    monkeypatch.setattr(platform, "uname", lambda: SimpleNamespace(release="5.4.0-35-generic", system="Linux"))
    with caplog.at_level(logging.WARNING):
        check_os_kernel()
    assert len(caplog.records) == 1 and "5.4.0" in caplog.records[0].msg and "5.5.0" in caplog.records[0].msg


def test_register_tracker_class_refuses_a_non_tracker_with_a_value_error() -> None:
    from hasten.tracking import register_tracker_class

    for error in (ValueError, TypeError):
        with pytest.raises(error, match="GeneralTracker subclass"):
            register_tracker_class(dict)


# -- Accelerate's module paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("module, name", [
    ("hasten.utils.deepspeed", "get_active_deepspeed_plugin"), ("hasten.utils.deepspeed", "DeepSpeedEngineWrapper"),
    ("hasten.utils.fsdp_utils", "fsdp2_prepare_model"), ("hasten.utils.environment", "str_to_bool"),
    ("hasten.utils.operations", "pad_input_tensors"), ("hasten.utils.other", "save"),
    ("hasten.utils.imports", "deepspeed_required"),
])
def test_names_import_from_accelerates_module_paths(module: str, name: str) -> None:
    import importlib

    import hasten.utils

    assert getattr(importlib.import_module(module), name) is getattr(hasten.utils, name)  # the same object
    with pytest.raises(AttributeError, match=f"module '{module}' has no attribute 'no_such_name'"):
        getattr(importlib.import_module(module), "no_such_name")


def test_save_of_a_state_dict_with_shared_tensors_logs_and_stores_each_once(tmp_path, caplog) -> None:
    # As Accelerate: one WARNING record ("Removed shared tensor ...") on its logger, word replaced; no Python
    # warning (which -W error would turn into an exception). hasten's record also names each tie.
    from safetensors.torch import load_file

    from hasten.utils import save

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = self.a

    model = Tied()
    path = tmp_path / "model.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level("WARNING"):
            save(model.state_dict(), path, safe_serialization=True)
    [record] = caplog.records
    assert record.name == "hasten.utils.other" and record.levelname == "WARNING"
    assert record.getMessage().startswith("Removed shared tensor ['b.bias', 'b.weight'] while saving")
    assert "'b.weight' (same tensor as 'a.weight')" in record.getMessage()
    assert sorted(load_file(str(path))) == ["a.bias", "a.weight"]


def test_prepare_refuses_a_quantized_model_with_disk_offload(fresh_state) -> None:
    from hasten import Accelerator

    acc = Accelerator()
    model = torch.nn.Linear(2, 2)
    model.is_loaded_in_8bit = True  # what transformers sets on a bitsandbytes model
    model.hf_device_map = {"": "disk"}
    with pytest.raises(ValueError, match="8-bit or 4-bit precision with CPU or disk offload"):
        acc.prepare_model(model)
    model.is_loaded_in_8bit = False  # not quantised: the map alone is no reason to refuse
    assert getattr(acc.prepare_model(model), "_is_hasten_prepared", False)


def test_plugins_and_fsdp_value_lists_import_from_accelerates_module_paths():
    """Scripts (and transformers' own source) import the plugins from ``utils.dataclasses`` and the
    FSDP value lists from ``utils.constants``; the lists hold Accelerate's values."""
    import hasten.utils as utils
    from hasten.utils import constants, dataclasses

    for name in ("DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "TorchTensorParallelPlugin",
                 "TorchTensorParallelConfig", "TorchContextParallelConfig"):
        assert getattr(dataclasses, name) is getattr(utils, name), name
    assert constants.FSDP_SHARDING_STRATEGY == ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                                "HYBRID_SHARD_ZERO2"]
    assert constants.FSDP_AUTO_WRAP_POLICY == ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
    assert constants.FSDP_BACKWARD_PREFETCH == ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
    assert constants.FSDP_STATE_DICT_TYPE == ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
    assert constants.FSDP2_STATE_DICT_TYPE == ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]


def test_context_parallel_handler_comes_from_the_environment_when_not_given(monkeypatch):
    from hasten.utils import ParallelismConfig, TorchContextParallelConfig

    for setting in ("allgather", "alltoall"):
        monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", setting)
        config = ParallelismConfig(cp_size=2)
        assert isinstance(config.cp_handler, TorchContextParallelConfig)
        assert config.cp_handler.cp_comm_strategy == setting
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "ring")
    with pytest.raises(ValueError, match="^Invalid cp_comm_strategy: ring .*use one of"):
        ParallelismConfig(cp_size=2)
    assert ParallelismConfig(cp_size=1).cp_handler is None
