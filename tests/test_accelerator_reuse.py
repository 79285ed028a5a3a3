"""Accelerators created again in one process, after a state reset, and through pickle."""

import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.state import AcceleratorState
from hasten.utils import ProjectConfiguration


def test_a_second_accelerator_without_mixed_precision_keeps_the_first_ones(fresh_state):
    first = Accelerator(cpu=True, mixed_precision="fp16")
    second = Accelerator(cpu=True)  # e.g. a helper building its own Accelerator
    assert second.mixed_precision == "fp16" and second.scaler is not None
    assert Accelerator(cpu=True, mixed_precision="fp16").mixed_precision == "fp16"
    with pytest.raises(ValueError, match="already runs with mixed_precision='fp16'; a second Accelerator asked for "
                                         "'bf16'"):
        Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match="'fp17'"):
        Accelerator(cpu=True, mixed_precision="fp17")
    assert first.mixed_precision == "fp16"


def test_an_accelerator_used_after_a_state_reset_says_what_happened(fresh_state):
    old = Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(AttributeError, match=r"AcceleratorState\.\w+ is gone with the process state\. "
                                             r"Create a new Accelerator after the reset"):
        old.prepare(nn.Linear(2, 2))
    with pytest.raises(AttributeError, match="num_processes is gone"):
        old.num_processes
    assert not hasattr(old.state, "device")  # still an AttributeError for hasattr()
    new = Accelerator(cpu=True)
    assert isinstance(new.prepare(nn.Linear(2, 2)), nn.Linear)


def test_the_reset_error_starts_like_accelerates(fresh_state):
    # Scripts written for Accelerate check for its wording: "`AcceleratorState` object has no attribute".
    old = Accelerator(cpu=True)
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError) as caught:
        old.prepare(nn.Linear(1, 1))
    assert str(caught.value.args[0]).startswith("`AcceleratorState` object has no attribute `distributed_type`. "
                                                "This happens if `AcceleratorState._reset_state()` was called")
    assert "Create a new Accelerator after the reset" in str(caught.value)


def test_destroy_process_group_works_after_an_accelerator_state_reset(fresh_state):
    # Accelerate's test script resets AcceleratorState, then ends with state.destroy_process_group().
    state = Accelerator(cpu=True).state
    AcceleratorState._reset_state()
    state.destroy_process_group()  # the process state (PartialState) is still there: nothing to explain
    assert AcceleratorState.destroy_process_group is not None


def test_an_accelerator_survives_a_pickle_round_trip(fresh_state, tmp_path):
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2, resume="auto",
                      project_config=ProjectConfiguration(tmp_path, automatic_checkpoint_naming=True))
    model, dl = acc.prepare(nn.Linear(1, 1), DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    acc.save_state(blocking=False)  # a thread and staging buffers: process-local, not pickled
    acc.wait_for_checkpoint()
    copy = pickle.loads(pickle.dumps(acc))
    assert copy.state.__dict__ == acc.state.__dict__ and copy.state.__dict__ is acc.state.__dict__
    assert copy.gradient_state.__dict__ is acc.gradient_state.__dict__
    assert (copy.gradient_accumulation_steps, copy.num_processes, copy.device) == (2, 1, acc.device)
    assert [b[0].tolist() for b in copy._dataloaders[0]] == [b[0].tolist() for b in dl]
    assert copy.resume == "auto" and copy._auto_resume.accelerator is copy  # the plan follows the copy
    assert copy.save_state().endswith("checkpoint_1")
