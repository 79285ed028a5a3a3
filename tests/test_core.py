"""The training core on 1 and 2 real processes (gloo), plus in-process checks of bad input."""

import pytest
import torch
from torch import nn

from distributed import check_names, run_checks

CORE_CHECKS = check_names("checks_core")


@pytest.fixture(scope="module")
def one_rank():
    return run_checks("checks_core", world_size=1)


@pytest.fixture(scope="module")
def two_ranks():
    return run_checks("checks_core", world_size=2)


@pytest.mark.parametrize("name", CORE_CHECKS)
def test_core_one_process(one_rank, name):
    one_rank.assert_passed(name)


@pytest.mark.parametrize("name", CORE_CHECKS)
def test_core_two_processes(two_ranks, name):
    values = two_ranks.assert_passed(name)
    if name == "check_properties":
        assert values == [["main"], ["last", "p1"]]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"mixed_precision": "fp32"}, ["'fp32'", "bf16"]),
        ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps=0", ">= 1"]),
        ({"gradient_accumulation_steps": 2.5}, ["2.5", ">= 1"]),
        ({"log_with": "wandbb"}, ["wandbb", "log_with", "did you mean 'wandb'"]),
        ({"kwargs_handlers": [object()]}, ["kwargs_handlers", "GradScalerKwargs"]),
        ({"not_an_argument": 1}, ["not_an_argument"]),
    ],
)
def test_bad_accelerator_arguments(fresh_state, kwargs, words):
    from hasten import Accelerator

    with pytest.raises((ValueError, TypeError, NotImplementedError)) as err:
        Accelerator(cpu=True, **kwargs)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_env_mixed_precision_is_read_under_both_prefixes(fresh_state, monkeypatch):
    from hasten import Accelerator
    from hasten.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert Accelerator(cpu=True).mixed_precision == "bf16"
    AcceleratorState._reset_state(reset_partial_state=True)
    monkeypatch.setenv("HASTEN_MIXED_PRECISION", "fp16")
    assert Accelerator(cpu=True).mixed_precision == "fp16"
    AcceleratorState._reset_state(reset_partial_state=True)
    monkeypatch.setenv("HASTEN_MIXED_PRECISION", "half")
    with pytest.raises(ValueError, match="HASTEN_MIXED_PRECISION"):
        Accelerator(cpu=True)


def test_env_gradient_accumulation(fresh_state, monkeypatch):
    from hasten import Accelerator

    monkeypatch.setenv("HASTEN_GRADIENT_ACCUMULATION_STEPS", "3")
    assert Accelerator(cpu=True).gradient_accumulation_steps == 3


def test_prepare_rejects_foreign_wrapper(fresh_state):
    from hasten import Accelerator

    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="DataParallel.*plain nn.Module"):
        acc.prepare(nn.DataParallel(nn.Linear(2, 2)))


def test_bf16_unsupported_hardware_raises(monkeypatch):
    from hasten.precision import check_precision_supported

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    with pytest.raises(ValueError, match="Tesla T4.*fp16"):
        check_precision_supported("bf16", torch.device("cuda", 0))


def test_accumulation_plugin_conflict(fresh_state):
    from hasten import Accelerator, GradientAccumulationPlugin

    with pytest.raises(ValueError, match="num_steps"):
        Accelerator(cpu=True, gradient_accumulation_steps=2,
                    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3, sync_each_batch=True))
    assert acc.gradient_accumulation_steps == 3 and acc.gradient_state.sync_each_batch


def test_init_process_group_timeout_type(fresh_state):
    from hasten.state import PartialState
    from hasten.topology import Topology

    with pytest.raises(TypeError, match="timedelta"):
        PartialState._init_process_group(Topology(world_size=2), torch.device("cpu"), "gloo", {"timeout": 30})
