"""Checks run in 2 real processes by tests/test_save_group.py."""

import os

import torch
from torch import nn

from hasten import Accelerator


def check_save_group_is_made_with_the_process_group():
    from hasten import group_lifetime
    from hasten.checkpointing import commit

    acc = Accelerator()
    model = acc.prepare(nn.Linear(4, 3))
    made = list(group_lifetime._SAVE_GROUP)  # before any save
    exists = bool(made) and made[0][1] is not None
    timeout = made[0][1]._get_backend(torch.device("cpu")).options._timeout.total_seconds() if exists else None
    acc.save_state(os.path.join(os.environ["HASTEN_TEST_TMP"], "save_group"), blocking=False)
    acc.wait_for_checkpoint()
    same = exists and commit.save_group() is made[0][1]
    del model
    return {"exists": exists, "timeout": timeout, "same_after_save": same}
