"""DeepSpeed engine checkpoints under attack on 2 real processes (see tests/test_attack_code.py): one
rank's engine file replaced by a code payload or damaged, then ``load_state`` by the layout that wrote it
(DeepSpeed's own ``load_checkpoint``): every process raises the same error naming the file, no process
waits in a collective, nothing in the file runs, nothing changes."""

import io
import os
import shutil
from contextlib import redirect_stdout

import torch
from attack_payloads import PAYLOADS, RAN
from checks_deepspeed import _trained  # noqa: E402 - the ZeRO runs of the DeepSpeed checks
from checks_fsdp import _data

from distributed import tamper

FULL = bool(os.environ.get("HASTEN_ATTACK_FULL"))
# (ZeRO stage, file of process 1, payload): the default sample, then the whole grid.
def _partition_resized(data: bytes, marker: str) -> bytes:
    """A ZeRO-3 partition file that passes every format check but whose fp32 partition lost half its
    elements (a size claim DeepSpeed would only meet inside its load, after the ranks agreed)."""
    state = torch.load(io.BytesIO(data), weights_only=False)  # the test's own file: trusted
    groups = state["optimizer_state_dict"]["fp32_flat_groups"]
    groups[0] = groups[0][: groups[0].numel() // 2].clone()
    out = io.BytesIO()
    torch.save(state, out)
    return out.getvalue()


PAYLOADS = {**PAYLOADS, "partition_resized": ("damage", _partition_resized)}
_SAMPLE = [(3, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "torchscript"),
           (3, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "partition_resized"),
           (3, "zero_pp_rank_1_mp_rank_00_model_states.pt", "gadget"),
           (3, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "truncated_half"),
           (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "constants_added"),
           (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "flip_directory")]
_FILES = {3: ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"],
          2: ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]}
_CASES = ([(s, f, p) for s in (3, 2) for f in _FILES[s] for p in PAYLOADS if p != "partition_resized"]
          + [_SAMPLE[1]]) if FULL else _SAMPLE


def _outcomes(stage: int) -> list:
    """For each case of ``stage``: (case, error class, message), judged on this process."""
    root = os.environ["HASTEN_TEST_TMP"]
    good = os.path.join(root, f"good{stage}")
    acc, model = _trained(stage, good)
    results = []
    for i, (s, name, payload) in enumerate(c for c in _CASES if c[0] == stage):
        # (a flip in tensor data that no format check can see loads: the state before each case is the reference)
        before = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
        evil = os.path.join(root, f"evil{stage}_{i}")
        marker = os.path.join(root, f"marker{stage}_{i}")
        rel = os.path.join("deepspeed", "model_0", name)
        if acc.is_main_process:
            shutil.copytree(good, evil)
            with open(os.path.join(good, rel), "rb") as f:
                data = PAYLOADS[payload][1](f.read(), marker)
            tamper(evil, rel, data)
        acc.wait_for_everyone()
        out = io.StringIO()
        try:
            with redirect_stdout(out):
                acc.load_state(evil)
            error = None
        except Exception as e:  # noqa: BLE001 - judged below
            error = e
        acc.wait_for_everyone()
        assert RAN not in out.getvalue() and not os.path.exists(marker), f"{payload} in {name} ran code"
        if PAYLOADS[payload][0] == "code" or payload == "partition_resized":
            assert error is not None, f"{payload} in {name} loaded"
        if error is not None:
            assert os.path.join(evil, rel) in str(error), f"the error does not name {rel}: {error}"
            assert "nothing was changed" in str(error), error
            after = acc.get_state_dict(model)
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            assert not changed, f"the refused load of {payload} in {name} changed {changed}: {error}"
        results.append([payload, name, type(error).__name__, str(error).replace(evil, "<folder>")])
    acc.load_state(good)  # the untampered copy still resumes
    if stage == 3:
        results.append(_swapped_after_the_check(acc, model, root))
    return results


def check_zero3_one_rank_file_tampered():
    return _outcomes(3)


def check_zero2_one_rank_file_tampered():
    return _outcomes(2)


def _swapped_after_the_check(acc, model, root: str) -> bool:
    """A file swapped for a TorchScript archive after hasten checked it, before DeepSpeed's load_checkpoint
    (ZeRO-3, real engines): DeepSpeed reads every file through the checkpoint engine hasten gives it, so the
    checked contents load and the archive never runs."""
    from attack_payloads import torchscript

    from hasten.checkpointing import deepspeed_state

    folder = os.path.join(root, "swap")
    acc.save_state(folder)
    saved = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    engine_dir = os.path.join(folder, "deepspeed", "model_0")
    checked = deepspeed_state.refuse_foreign_pickles(engine_dir, deepspeed_state.own_files(engine_dir,
                                                                                            acc.process_index))
    assert len(checked) == 2, sorted(checked)  # this process's model and optimizer states
    acc.wait_for_everyone()
    if acc.is_main_process:
        for name in os.listdir(engine_dir):
            with open(os.path.join(engine_dir, name), "wb") as f:
                f.write(torchscript())
    acc.wait_for_everyone()
    engine = model  # the prepared model is the DeepSpeed engine
    x, y = (t[:2] for t in _data().tensors)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))  # one more step: the load must undo it
    engine.step()
    assert any(not torch.equal(saved[k], v) for k, v in acc.get_state_dict(model).items())
    own = engine.checkpoint_engine
    out = io.StringIO()
    engine.checkpoint_engine = deepspeed_state.checked_engine(checked)
    try:
        with redirect_stdout(out):
            loaded, _ = engine.load_checkpoint(os.path.join(folder, "deepspeed"), tag="model_0")
    finally:
        engine.checkpoint_engine = own
    assert loaded is not None and RAN not in out.getvalue()
    after = acc.get_state_dict(model)
    assert all(torch.equal(saved[k], after[k]) for k in saved)
    return True


def check_zero_checkpoint_for_merge_weights():
    """A ZeRO-2 checkpoint for the merge-weights attack test (the one the ZeRO-2 check wrote)."""
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], "good2")
    if not os.path.isdir(folder):
        _trained(2, folder)
    return os.path.join(folder, "deepspeed", "model_0")
