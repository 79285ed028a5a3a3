"""Multi-process bodies of test_issue24_rest.py (issue 24's remaining items), run in every rank by
tests/distributed.py: DeepSpeed clipping driven by ``clip_grad_norm_`` alone (item 2); a save that
fails on one process before a collective save hook (item 11)."""

import torch
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.utils.deepspeed_plugin import DeepSpeedPlugin

from checks_fsdp import _data, _model, _reference  # the shared model, data and one-process reference


def _deepspeed(stage: int, **plugin) -> Accelerator:
    reset_state()
    return Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage, **plugin))


def _clipped_run(acc: Accelerator, clips: list) -> tuple[dict, list]:
    """SGD over the shared data; ``clips[i]`` is step i's max_norm (None: no clip_grad_norm_ call)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    norms = []
    for clip, (x, y) in zip(clips, loader):
        acc.backward(nn.functional.mse_loss(model(x), y))
        if clip is not None:
            norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in acc.get_state_dict(model).items()}, norms


def _reference_with(clips: list, device) -> tuple[dict, list]:
    """One process, batch 2x2, torch's clip_grad_norm_ where ``clips`` says."""
    model = _model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(torch.utils.data.DataLoader(_data(), batch_size=2))
    norms = []
    for step, clip in enumerate(clips):
        x = torch.cat([b[0] for b in batches[2 * step:2 * step + 2]]).to(device)
        y = torch.cat([b[1] for b in batches[2 * step:2 * step + 2]]).to(device)
        nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in model.state_dict().items()}, norms


def _clip_without_flag(stage: int, against_config: bool) -> dict:
    """clip_grad_norm_(0.05) every step, no gradient_clipping anywhere: the weights and norms of torch's
    one-process loop (and, with ``against_config``, exactly those of gradient_clipping=0.05 in the config)."""
    clips = [0.05] * 4
    got, norms = _clipped_run(_deepspeed(stage), clips)
    ref, ref_norms = _reference(4, 1, 0.05, 2, 2, torch.device("cpu"))  # cpu-on-purpose: the reference's weights
    worst_ref = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert worst_ref < 1e-5, worst_ref
    assert all(abs(a - b) < 1e-5 for a, b in zip(norms, ref_norms)) and len(norms) == 4, (norms, ref_norms)
    out = {"worst_ref": worst_ref, "norms": norms}
    if against_config:
        configured, configured_norms = _clipped_run(_deepspeed(stage, gradient_clipping=0.05), clips)
        out["worst_config"] = max(float((got[k] - configured[k]).abs().max()) for k in got)
        assert out["worst_config"] == 0.0 and norms == configured_norms, (out, configured_norms)
    return out


def check_zero2_clip_grad_norm_without_gradient_clipping():
    return _clip_without_flag(2, against_config=True)


def check_zero3_clip_grad_norm_without_gradient_clipping():
    return _clip_without_flag(3, against_config=False)


def check_zero2_clip_follows_each_call():
    """Clipping applies on the steps that call clip_grad_norm_, at that call's max_norm, as torch's does.
    gradient_clipping=0: a step without the call is not clipped (left "auto", Accelerate's 1.0 clips it)."""
    clips = [0.05, None, 0.02, 0.5]
    got, norms = _clipped_run(_deepspeed(2, gradient_clipping=0.0), clips)
    ref, ref_norms = _reference_with(clips, torch.device("cpu"))  # cpu-on-purpose: the reference's weights
    worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert worst < 1e-5, worst
    assert len(norms) == 3 and all(abs(a - b) < 1e-5 for a, b in zip(norms, ref_norms)), (norms, ref_norms)
    return {"worst": worst, "norms": norms}


def check_save_hook_failing_on_one_process_is_agreed_before_a_collective_hook():
    """Rank 1's first save pre-hook fails; the second hook is collective. Every process must reach
    it or learn of the failure first: both raise the same error naming the path, quickly, and
    nothing is left behind (no hang until the process group's timeout).

    With automatic naming, whose save is collective: a save into a folder the caller names, of an
    unsharded model, involves no collective (process 0 may save alone, as in Accelerate), so its hooks
    run on each process on their own there (docs/checkpoints.md)."""
    import os
    import time

    import torch.distributed as dist

    from hasten.utils import ProjectConfiguration

    reset_state()
    project = os.path.join(os.environ["HASTEN_TEST_TMP"], "hook_fails_on_one")
    acc = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True))
    model = acc.prepare(nn.Linear(4, 2))
    root = os.path.join(project, "checkpoints")

    def failing(models, weights, folder):
        if acc.process_index == 1:
            raise PermissionError(f"cannot write {os.path.join(folder, 'extra.bin')}")

    def collective(models, weights, folder):
        total = torch.ones(1, device=acc.device)
        dist.all_reduce(total)
        assert float(total) == acc.num_processes

    handles = [acc.register_save_state_pre_hook(failing), acc.register_save_state_pre_hook(collective)]
    start = time.monotonic()
    try:
        acc.save_state()
        raise AssertionError("save_state succeeded although process 1's hook failed")
    except RuntimeError as e:
        message = str(e)
    elapsed = time.monotonic() - start
    for handle in handles:
        handle.remove()
    acc.wait_for_everyone()
    assert "PermissionError" in message and "extra.bin" in message and "process 1" in message, message
    assert elapsed < 30, elapsed
    assert os.listdir(root) == [], os.listdir(root)
    target = acc.save_state()  # the processes are still in step: a later save works
    assert os.path.exists(os.path.join(target, "manifest.json"))
    return {"message": message, "elapsed": elapsed}
