"""Ulysses sequence parallelism under DeepSpeed (DeepSpeed's UlyssesSPAttentionHF, its sp groups handed to
the engine as ``mpu``) on 2 real processes (see distributed.py and test_sequence_split_deepspeed.py),
against one process on the same batches (the model, batches and reference of checks_sequence_split)."""

import torch

from checks_sequence_split import STEPS, _batch, _model, _reference, _refusal, split_step
from distributed import reset_state
from hasten import Accelerator
from hasten.utils import ParallelismConfig
from hasten.strategies.deepspeed_ulysses import engine_sums_over_sp
from hasten.utils.deepspeed_plugin import DeepSpeedPlugin


def _sgd(params):
    """SGD, not AdamW: its step is proportional to the gradient, so a gradient summed where it should be
    averaged over the sp processes (twice too large) shows in the weights."""
    return torch.optim.SGD(params, lr=0.5)


def _sp_deepspeed(stage: int, plugin=None, **config) -> dict:
    reset_state()
    ds = DeepSpeedPlugin(hf_ds_config=dict(plugin, gradient_clipping=0.0)) if plugin else \
        DeepSpeedPlugin(zero_stage=stage, gradient_clipping=0.0)
    acc = Accelerator(parallelism_config=ParallelismConfig(sp_size=2, **config), deepspeed_plugin=ds)
    model = _model()
    opt = _sgd(model.parameters())
    # One dataloader of the steps' input ids, 2 sequences a batch: sp is no data axis, so both
    # processes must read the same (whole) batch, which maybe_context_parallel then cuts.
    rows = [row for step in range(STEPS) for row in _batch(step, "cpu")[0]]
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    inner = acc.unwrap_model(model)
    losses, same_batches = [], []
    for step, ids in enumerate(loader):
        want_ids, pos, labels = _batch(step, acc.device)
        same_batches.append(bool(torch.equal(ids, want_ids)))
        _, loss = split_step(acc, model, ids, pos, labels)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    want = _reference(acc.device, _sgd)
    got = acc.get_state_dict(model)
    return {"loss": max(abs(a - b) for a, b in zip(losses, want["losses"])), "losses": losses,
            "params": max(float((got[n].float().cpu() - p.cpu()).abs().max()) for n, p in want["params"].items()),
            "same_batches": same_batches, "steps": len(losses), "attn": inner.config._attn_implementation,
            "engine": type(model).__name__, "train_batch_size": acc.strategy.config["train_batch_size"],
            "sums_over_sp": engine_sums_over_sp(model)}


def check_sp2_zero2_equals_one_process():
    return _sp_deepspeed(2)


def check_sp2_zero3_equals_one_process():
    return _sp_deepspeed(3, sp_backend="deepspeed")  # Accelerate's spelling: the same engine path


def check_sp2_zero3_without_reduce_scatter_equals_one_process():
    return _sp_deepspeed(3, plugin={"zero_optimization": {"stage": 3, "reduce_scatter": False}})


def check_sp_deepspeed_refusals():
    out = {}
    reset_state()
    out["no_deepspeed"] = _refusal(lambda: Accelerator(parallelism_config=ParallelismConfig(sp_size=2,
                                                                                            sp_backend="deepspeed")))
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(sp_size=2), deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    few_kv = _model(heads=4, kv_heads=1)
    out["kv_heads"] = _refusal(lambda: acc.prepare(few_kv, torch.optim.AdamW(few_kv.parameters()),
                                                   torch.utils.data.DataLoader(list(range(4)), batch_size=2)))
    return out


def check_plain_deepspeed_after_sp():
    """An engine without sp built after an sp engine in the same process: DeepSpeed leaves the sp engine's
    mpu in deepspeed.utils.groups; hasten clears it, so this engine reduces over all processes as usual."""
    from deepspeed.utils import groups

    reset_state()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=0.0))
    model = _model()
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    model, _, _ = acc.prepare(model, _sgd(model.parameters()), loader)
    return {"sequence_parallel_size": model.sequence_parallel_size, "mpu": repr(groups.mpu),
            "train_batch_size": acc.strategy.config["train_batch_size"]}


def _dp2_sp2(stage: int) -> dict:
    """4 processes: dp_replicate=2 x sp=2. Each sp pair reads its own row of the batch (the loader shards
    by the data-parallel rank); the one-process reference takes the data-parallel mean of the two rows'
    token means, as the engine averages over data-parallel processes."""
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, sp_size=2),
                      deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage, gradient_clipping=0.0))
    model = _model()
    rows = [row for step in range(STEPS) for row in _batch(step, "cpu")[0]]
    model, opt, loader = acc.prepare(model, _sgd(model.parameters()), torch.utils.data.DataLoader(rows, batch_size=1))
    dp = acc.process_index // 2
    losses, same = [], []
    for step, ids in enumerate(loader):
        want, pos, labels = (t[dp:dp + 1].clone() for t in _batch(step, acc.device))
        same.append(bool(torch.equal(ids, want)))
        _, loss = split_step(acc, model, ids, pos, labels)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    ref = _model()
    ref_opt = _sgd(ref.parameters())
    ref_losses = []
    for step in range(STEPS):
        ids, pos, labels = _batch(step, "cpu")
        per_row = [ref(input_ids=ids[i:i + 1], position_ids=pos[i:i + 1], labels=labels[i:i + 1],
                       shift_labels=labels[i:i + 1]).loss for i in range(2)]
        ((per_row[0] + per_row[1]) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(per_row[dp]))
    got = acc.get_state_dict(model)
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "same_batches": same,
            "params": max(float((got[n].float().cpu() - p.detach()).abs().max()) for n, p in ref.named_parameters()),
            "train_batch_size": acc.strategy.config["train_batch_size"]}


def check_dp2_sp2_zero2_equals_one_process():
    return _dp2_sp2(2)


def check_dp2_sp2_zero3_equals_one_process():
    return _dp2_sp2(3)
