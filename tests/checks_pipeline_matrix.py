"""The pipeline combinations of 4 processes that checks_pipeline_compose.py leaves out (see
test_pipeline_matrix.py): every other schedule, bf16 and checkpoints, each composed with FSDP2
(pp_size=2 x dp_shard_size=2) and with tensor parallelism (pp_size=2 x tp_size=2).

Training checks compare with one process on the same global batches, as checks_pipeline_compose does:
losses, the first update's gradients, the clipped norms and the parameters after 3 AdamW steps
(gradient accumulation 2, clip_grad_norm_).
"""

import json
import os

import torch
import torch.distributed as dist

from checks_pipeline import ACCUM, _bf16_lm_ref, _llama, _reference, _worst
from checks_pipeline_compose import (_compare, _full, _global_batches, _lm_full_data, _lm_ref, _merged, _replicas_mean,
                                     _train, _world)
from distributed import reset_state
from hasten import Accelerator
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin
from hasten.utils.parallelism_config import PP_MULTI_STAGE, ParallelismConfig

# Every schedule hasten accepts but 1F1B (checks_pipeline_compose's); 4 microbatches: as many as the 4 stages
# of the multi-stage ones (pp_size=2 x pp_stages_per_rank=2).
SCHEDULES = ("GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MICRO = 4


def _accelerator(schedule: str, fsdp: bool, **kwargs) -> Accelerator:
    reset_state()
    sizes = {"dp_shard_size": 2} if fsdp else {"tp_size": 2}
    extra = {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2)} if fsdp else {}
    acc = Accelerator(gradient_accumulation_steps=ACCUM, **extra, **kwargs, parallelism_config=ParallelismConfig(
        pp_size=2, pp_schedule=schedule, pp_microbatches=MICRO, pp_stages_per_rank=2 if schedule in PP_MULTI_STAGE else 1,
        **sizes))
    assert type(acc.strategy).__name__ == "PipelineStrategy"
    return acc


# AdamW's eps under TP: its step divides by sqrt(v) + eps, so on a gradient element near eps (this llama has some
# of about 1e-9) the float32 rounding of the split matmuls (~2e-10 there) moves the parameter by up to lr / eps =
# 1e6 times as much: 7e-5 after 3 steps with eps=1e-8 (1F1B too), 1e-6 times less with eps=1e-6. FSDP2 sums the
# same products in another order only in its reduce-scatter, and passes with torch's default eps.
TP_EPS = 1e-6


def _data_and_replicas(fsdp: bool) -> tuple:
    """FSDP2: 2 replicas (the dp_shard pair) read 4 samples each; TP: both tp ranks read the same 4."""
    replicas = 2 if fsdp else 1
    return _lm_full_data(4 * replicas * ACCUM * 3), replicas


def _each_schedule(fsdp: bool) -> dict:
    out = {}
    for schedule in SCHEDULES:
        acc = _accelerator(schedule, fsdp)
        data, replicas = _data_and_replicas(fsdp)
        out[schedule] = _compare(acc, _llama, data, 4, replicas, _lm_ref, eps=1e-8 if fsdp else TP_EPS)
    return out


def check_each_schedule_with_fsdp2_equals_one_process():
    """pp_size=2 x dp_shard_size=2 under every schedule but 1F1B."""
    if _world() != 4:
        return "skipped"
    return _each_schedule(fsdp=True)


def check_each_schedule_with_tp_equals_one_process():
    """pp_size=2 x tp_size=2 under every schedule but 1F1B."""
    if _world() != 4:
        return "skipped"
    return _each_schedule(fsdp=False)


def _bf16(fsdp: bool) -> dict:
    """mixed_precision="bf16" (autocast around each stage's forward) against one process under autocast, with
    checks_pipeline's bf16 measures."""
    acc = _accelerator("1F1B", fsdp, mixed_precision="bf16")
    data, replicas = _data_and_replicas(fsdp)
    model, losses, norms, grads, params = _train(acc, _llama, data, 4)
    losses = _replicas_mean(losses)
    batches = _global_batches(data, 4, replicas)
    ref_losses, ref_norms, ref_grads, ref_params = _reference(_llama, batches, _bf16_lm_ref)
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "norm": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "grad": max(float((grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()) for k in ref_grads),
            "param": _worst(params, ref_params),
            "first_update_loss": max(abs(a - b) for a, b in zip(losses[:ACCUM], ref_losses[:ACCUM])),
            "first_norm": abs(norms[0] - ref_norms[0]) / ref_norms[0],
            "bf16_vs_fp32_loss": max(abs(a - b) for a, b in zip(ref_losses, _reference(_llama, batches, _lm_ref)[0])),
            "kinds": sorted({type(p).__name__ for _, p in model.named_stage_parameters()})}


def check_bf16_with_fsdp2_and_tp_equals_one_process_bf16():
    """pp_size=2 x dp_shard_size=2 and pp_size=2 x tp_size=2 under mixed_precision="bf16"."""
    if _world() != 4:
        return "skipped"
    return {"fsdp2": _bf16(True), "tp": _bf16(False)}


# -- checkpoints -------------------------------------------------------------------------------------
# A llama under pp_size=2 x dp_shard_size=2 (FSDP2) or x tp_size=2, with AdamW, a StepLR scheduler, gradient
# accumulation 2 and a shuffled loader; ``PPMX_TMP`` is shared with the test, which reads the saved checkpoints
# on one process (and wrote the one-process checkpoint ``PPMX_TMP/single`` before the launch).
CKPT_BATCHES, CKPT_SAVE_AT = 8, 4  # 4 optimizer steps; saved after the 2nd (a sync step: allowed)


def _ckpt_setup(fsdp: bool) -> tuple:
    reset_state()
    sizes = {"dp_shard_size": 2} if fsdp else {"tp_size": 2}
    extra = {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2)} if fsdp else {}
    acc = Accelerator(gradient_accumulation_steps=ACCUM, **extra, parallelism_config=ParallelismConfig(
        pp_size=2, pp_schedule="GPipe", pp_microbatches=2, **sizes))
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = torch.utils.data.DataLoader(_lm_full_data(64), batch_size=4, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched


def _ckpt_run(acc, model, opt, sched, batches, count: int, folder=None, save_at=None) -> list:
    losses = []
    for i in range(count):
        x, y = next(batches)
        with acc.accumulate(model):
            out = model(input_ids=x, labels=y)
            acc.backward(out.loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(float(out.loss.detach()))
        if save_at is not None and i + 1 == save_at:
            acc.save_state(folder)
    return losses


def _full_params(model) -> dict:
    """Every parameter of the full model, whole (FSDP2 and TP shards gathered), on every process."""
    return _merged({k: _full(p) for k, p in model.named_stage_parameters()})


def _full_moments(model, opt) -> dict:
    """The optimizer state of every parameter, ``{name.key: tensor}``, whole, on every process."""
    state = {}
    for name, p in model.named_stage_parameters():  # the same order on every process of a stage: the collectives
        for key, value in opt.state[p].items():
            state[f"{name}.{key}"] = _full(value)
    return _merged(state)


def _ckpt_resume(fsdp: bool) -> dict:
    """save_state after 2 of 4 steps; a fresh run loading it (continue_dataloaders) ends with the same parameters.
    Process 0 writes what was saved (``<folder>.pt``) for the test's one-process load."""
    folder = os.path.join(os.environ["PPMX_TMP"], "fsdp2" if fsdp else "tp")
    acc, model, opt, loader, sched = _ckpt_setup(fsdp)
    whole = _ckpt_run(acc, model, opt, sched, iter(loader), CKPT_BATCHES, folder, save_at=CKPT_SAVE_AT)
    final = _full_params(model)
    acc, model, opt, loader, sched = _ckpt_setup(fsdp)
    acc.load_state(folder, continue_dataloaders=True)
    saved = {"params": _full_params(model), "moments": _full_moments(model, opt), "lr": opt.param_groups[0]["lr"]}
    rest = _ckpt_run(acc, model, opt, sched, iter(loader), CKPT_BATCHES - CKPT_SAVE_AT)
    param_diff = _worst(_full_params(model), final)
    loss_diff = max(abs(a - b) for a, b in zip(rest, whole[CKPT_SAVE_AT:]))
    assert len(rest) == CKPT_BATCHES - CKPT_SAVE_AT and param_diff < 1e-6 and loss_diff < 1e-6, (param_diff, rest, whole)
    if dist.get_rank() == 0:
        torch.save(saved, folder + ".pt")
    with open(os.path.join(folder, "manifest.json")) as f:
        layout = json.load(f)["layout"]
    return {"param": param_diff, "loss": loss_diff, "lr": saved["lr"], "layout": layout,
            "moments": len(saved["moments"]), "kinds": sorted({type(p).__name__ for _, p in model.named_stage_parameters()})}


def check_fsdp2_and_tp_checkpoints_resume_mid_epoch_exactly():
    """pp_size=2 x dp_shard_size=2, then pp_size=2 x tp_size=2: save_state mid-epoch, resume, same end."""
    if _world() != 4:
        return "skipped"
    return {"fsdp2": _ckpt_resume(True), "tp": _ckpt_resume(False)}


def check_one_process_checkpoint_loads_under_fsdp2_and_tp():
    """The one-process checkpoint the test wrote (``PPMX_TMP/single``) read at pp_size=2 x dp_shard_size=2 and at
    pp_size=2 x tp_size=2: every parameter and every Adam moment equal to the saved ones, gathered whole."""
    if _world() != 4:
        return "skipped"
    expected = torch.load(os.path.join(os.environ["PPMX_TMP"], "single.pt"), weights_only=True)
    out = {}
    for name, fsdp in (("fsdp2", True), ("tp", False)):
        acc, model, opt, loader, sched = _ckpt_setup(fsdp)
        acc.load_state(os.path.join(os.environ["PPMX_TMP"], "single"))
        params, moments = _full_params(model), _full_moments(model, opt)
        out[name] = {"param": _worst(params, expected["params"]), "moment": _worst(moments, expected["moments"]),
                     "lr": opt.param_groups[0]["lr"] == expected["lr"]}
        assert out[name]["param"] == 0 and out[name]["moment"] == 0 and out[name]["lr"], out[name]
    return out
