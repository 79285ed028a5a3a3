"""The order of a prepared shuffling DataLoader is the order the user had (issue 26, item 3).

After ``set_seed``, one process gets exactly the unprepared DataLoader's batches, epoch after
epoch; N processes share that global order (2 processes x B = 1 process x 2B per step), agree on
it even when their global generators differ, and resume it exactly from a checkpoint. The
Accelerate-compatible variants (``use_seedable_sampler``, a user's generator, an explicit
``RandomSampler``) are compared with accelerate 1.15 itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from checks_data_order import resume_run
from distributed import reset_state, run_checks
from hasten import Accelerator
from hasten.data_loader import prepare_data_loader
from hasten.utils import set_seed

EPOCHS = 3


def _epochs(loader, epochs: int = EPOCHS, training_draws: bool = True) -> list:
    """Batches of ``epochs`` passes; a draw from the global generator per step stands for training."""
    out = []
    for _ in range(epochs):
        for batch in loader:
            out.append(batch.tolist())
            if training_draws:
                torch.rand(1)  # dropout and the like consume the global generator between batches
    return out


@pytest.fixture
def fresh_state():
    reset_state()
    yield
    reset_state()


@pytest.mark.parametrize("make", [
    lambda data: DataLoader(data, batch_size=4, shuffle=True),
    lambda data: DataLoader(data, batch_size=4, sampler=RandomSampler(data)),
    lambda data: DataLoader(data, batch_size=3, shuffle=True, drop_last=True),
    lambda data: DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True, num_samples=10)),
], ids=["shuffle", "explicit_sampler", "drop_last", "replacement"])
def test_one_process_prepared_loader_yields_the_plain_loaders_batches(fresh_state, make):
    data = list(range(22))
    set_seed(42)
    plain = _epochs(make(data))
    after_plain = torch.rand(3).tolist()
    set_seed(42)
    acc = Accelerator()
    prepared = _epochs(acc.prepare(make(data)))
    assert prepared == plain
    assert torch.rand(3).tolist() == after_plain  # the global generator was used exactly as before
    assert len({tuple(b) for b in plain[:6]}) == 6  # a new order each epoch (not a repeat)


def test_one_process_user_generator_and_seedable_sampler_match_accelerate(fresh_state):
    from accelerate.data_loader import prepare_data_loader as accelerate_prepare

    data = list(range(20))
    cases = {
        "generator": dict(make=lambda: DataLoader(data, batch_size=4, shuffle=True,
                                                  generator=torch.Generator().manual_seed(3)), kwargs={}),
        "seedable": dict(make=lambda: DataLoader(data, batch_size=4, shuffle=True),
                         kwargs=dict(use_seedable_sampler=True)),
        "seedable_data_seed": dict(make=lambda: DataLoader(data, batch_size=4, shuffle=True),
                                   kwargs=dict(use_seedable_sampler=True, data_seed=11)),
        "seedable_generator": dict(make=lambda: DataLoader(data, batch_size=4, shuffle=True,
                                                           generator=torch.Generator().manual_seed(3)),
                                   kwargs=dict(use_seedable_sampler=True)),
    }
    for name, case in cases.items():
        set_seed(7)
        theirs = _epochs(accelerate_prepare(case["make"](), num_processes=1, process_index=0, **case["kwargs"]))
        set_seed(7)
        ours = _epochs(prepare_data_loader(case["make"](), num_processes=1, process_index=0, **case["kwargs"]))
        assert ours == theirs, name


def test_data_seed_alone_keeps_the_plain_order_and_says_so(fresh_state):
    from hasten import state as hasten_state

    data = list(range(12))
    set_seed(5)
    plain = _epochs(DataLoader(data, batch_size=3, shuffle=True))
    set_seed(5)
    hasten_state.warn_once.__defaults__[0].clear()
    with pytest.warns(UserWarning, match="use_seedable_sampler=True"):
        loader = prepare_data_loader(DataLoader(data, batch_size=3, shuffle=True), data_seed=9)
    assert _epochs(loader) == plain


def test_save_mid_epoch_and_load_in_a_fresh_process_resumes_the_exact_batches(fresh_state, tmp_path):
    folder = str(tmp_path / "ckpt")
    full = resume_run(folder, "full")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from checks_data_order import resume_run; "
            "print(json.dumps(resume_run(sys.argv[2], 'resume')))")
    done = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), folder],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # the fresh process goes on with the rest of epoch 1 and then epoch 2, as the uninterrupted run did
    assert json.loads(done.stdout.strip().splitlines()[-1]) == full[full.index("saved") + 1:]


# -- two processes ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two():
    return run_checks("checks_data_order", world_size=2)


def _plain_reference(seed: int, batch_size: int, size: int, epochs: int = EPOCHS) -> list:
    torch.manual_seed(seed)
    return _epochs(DataLoader(list(range(size)), batch_size=batch_size, shuffle=True), epochs, training_draws=False)


def test_two_processes_with_batch_b_take_the_steps_of_one_process_with_batch_2b(two):
    r0, r1 = two.assert_passed("check_two_by_b_is_one_by_2b")
    assert r0 == r1  # both ranks report the gathered steps
    assert r0["steps"] == _plain_reference(42, 6, 24)


def test_ranks_agree_when_their_global_generators_differ(two):
    r0, r1 = two.assert_passed("check_ranks_agree_with_different_generators")
    assert r0 == r1
    assert r0 == _plain_reference(100, 4, 20)  # process 0's generator decides the order


def test_two_process_resume_continues_the_global_order(two):
    r0, r1 = two.assert_passed("check_two_process_resume")
    for r in (r0, r1):
        assert r["resumed"] == r["expected"]
