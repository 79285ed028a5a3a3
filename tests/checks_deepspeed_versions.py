"""A DeepSpeed whose private interfaces changed (simulated by replacing them on DeepSpeed's own classes and
module inside this process): one clear version error naming DeepSpeed's version, never "damaged" nor a wrong
load (see test_deepspeed_versions.py; run on one process)."""

import contextlib
import os

import torch
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.utils.deepspeed_plugin import DeepSpeedPlugin


def _tmp(name):
    return os.path.join(os.environ["HASTEN_TEST_TMP"], name)


@contextlib.contextmanager
def _replaced(owner, name, value):
    """``owner.name`` replaced (deleted for None) inside the block: what another DeepSpeed version would have."""
    had = name in vars(owner)
    old = vars(owner).get(name)
    if value is None:
        delattr(owner, name)
    else:
        setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        elif hasattr(owner, name):
            delattr(owner, name)


def _trained(stage=2, **plugin):
    reset_state()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage, **plugin))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 4)), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.backward(model(torch.ones(2, 4, device=acc.device)).sum())
    opt.step()
    opt.zero_grad()
    return acc, model, opt


def _error(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test judges class and message
        return f"{type(e).__name__}: {e}"
    return None


def check_zero_to_fp32_changes_are_version_errors():
    from deepspeed.utils import zero_to_fp32

    from hasten.checkpointing.deepspeed_state import consolidated_weights

    acc, model, opt = _trained()
    folder = acc.save_state(_tmp("zero2"))
    engine_folder = os.path.join(folder, "deepspeed", "model_0")
    out = {}

    def fewer(world_size, fp32_flat_groups, zero_model_states):  # a signature another version might have
        raise AssertionError("called with the wrong arguments")

    with _replaced(zero_to_fp32, "_get_fp32_state_dict_from_zero2_checkpoint", fewer):
        out["signature"] = _error(lambda: consolidated_weights(engine_folder))
        reset_state()
        plain = Accelerator()
        plain_model = nn.Linear(4, 2)
        plain.prepare(plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.1))
        out["load_state"] = _error(lambda: plain.load_state(folder))
    with _replaced(zero_to_fp32, "zero_model_state", None):
        out["missing"] = _error(lambda: consolidated_weights(engine_folder))
    out["restored"] = sorted(consolidated_weights(engine_folder))
    return out


def check_checkpoint_engine_changes_are_version_errors():
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    acc, model, opt = _trained()
    folder = acc.save_state(_tmp("native"))
    out = {}

    def load(self, path, map_location=None, weights_only=True):
        raise AssertionError("never called")

    with _replaced(CheckpointEngine, "load", load):
        out["load signature"] = _error(lambda: acc.load_state(folder))
    engine = model
    own = engine.checkpoint_engine
    del engine.checkpoint_engine  # an engine of a version that keeps it elsewhere
    try:
        out["no checkpoint_engine"] = _error(lambda: acc.load_state(folder))
    finally:
        engine.checkpoint_engine = own
    out["loads after"] = _error(lambda: acc.load_state(folder))
    return out


def check_gradient_clipping_change_is_a_version_error():
    from deepspeed.runtime.engine import DeepSpeedEngine

    acc, model, opt = _trained(stage=0)
    acc.backward(model(torch.ones(2, 4, device=acc.device)).sum())
    with _replaced(DeepSpeedEngine, "gradient_clipping", lambda self: 0.0):  # no longer reads _config
        error = _error(lambda: acc.clip_grad_norm_(model.parameters(), 1.0))
    return {"error": error}
