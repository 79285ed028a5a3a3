"""Batches of any size, and padded language-model batches, under pipeline parallelism (see
test_pipeline_batches.py): every check compares with one process on the same global batches, on 2
real gloo processes (pp_size=2) or 4 (pp_size=2 x 2 replicas, or x FSDP2).

Compared: the loss of every micro-step, the gradients of the first update (every stage's, under the
original names), the clipped norm, and the parameters after 2 AdamW updates with gradient
accumulation 2 and ``clip_grad_norm_``.
"""

import os

import torch
import torch.distributed as dist
from torch import nn

from checks_pipeline import CLIP, WIDTH, _gather, _llama, _reference, _seq, _worst, train_loop
from checks_pipeline_compose import _merged
from distributed import reset_state
from hasten import Accelerator
from hasten.pipeline import pipeline_loss
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin
from hasten.utils.parallelism_config import ParallelismConfig

ACCUM, MICRO, TOL = 2, 4, 1e-5


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])


def _seq_batches(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), WIDTH, generator=g)
    at = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [(x[at[i]:at[i + 1]], x[at[i]:at[i + 1]].sin()) for i in range(len(sizes))]


def _lm_batch(g, rows, length, real, nearly_ignored=()):
    """``rows`` sequences padded on the right to ``length`` (``real[i]`` tokens each), labels -100 on the padding
    and, in the rows ``nearly_ignored``, on every token but the last real one."""
    ids = torch.randint(1, 64, (rows, length), generator=g)
    mask = (torch.arange(length) < torch.tensor(real).unsqueeze(1)).long()
    labels = ids.masked_fill(mask == 0, -100)
    for r in nearly_ignored:
        labels[r, :real[r] - 1] = -100
    ids = ids.masked_fill(mask == 0, 0)  # the pad token
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _lm_batches():
    """Rows and lengths change: 4x8 (microbatches of 1 row), then 6x10 (built again for 2 rows of 10 tokens: in the
    middle of the accumulation), then 3x5 and 5x10 completed to 8x10; microbatch 0 of each batch counts 1-2 tokens
    while the others count up to 9."""
    g = torch.Generator().manual_seed(7)
    return [_lm_batch(g, 4, 8, [8, 5, 8, 3], nearly_ignored=[0]),
            _lm_batch(g, 6, 10, [10, 4, 10, 7, 9, 10], nearly_ignored=[0, 1]),
            _lm_batch(g, 3, 5, [5, 2, 4], nearly_ignored=[0]),
            _lm_batch(g, 5, 10, [10, 10, 6, 10, 8], nearly_ignored=[0, 1])]


def _train(acc, model, batches, forward, gather=_gather):
    """The four-line loop over ``batches``; the losses, the clipped norms, the first update's gradients, the
    parameters at the end, and how many times torch's stages were built (distinct schedules seen)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    schedules = []

    def seen(prepared) -> None:  # torch's stages built again show as a new schedule object
        if not any(s is prepared._schedule for s in schedules):
            schedules.append(prepared._schedule)

    losses, norms, grads = train_loop(acc, model, opt, batches, forward, gather, each_step=seen)
    return losses, norms, grads, acc.strategy.model_state_dict(model, everyone=True), len(schedules)


def _compared(got, ref):
    losses, norms, grads, params, builds = got
    ref_losses, ref_norms, ref_grads, ref_params = ref
    assert len(losses) == len(ref_losses) and len(norms) == len(ref_norms) == len(ref_losses) // ACCUM
    res = {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
           "norm": max(abs(a - b) for a, b in zip(norms, ref_norms)),
           "grad": _worst(grads, ref_grads), "param": _worst(params, ref_params), "builds": builds}
    assert all(res[k] < TOL for k in ("loss", "norm", "grad", "param")), (res, losses, ref_losses)
    return res


def _seq_forward(model, batch):
    return model(batch[0], labels=batch[1])


def _seq_ref(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _lm_forward(model, batch):
    return model(**batch)


def _lm_ref(model, batch):
    return model(**batch).loss


def _pp(schedule, micro=MICRO):
    reset_state()
    return Accelerator(gradient_accumulation_steps=ACCUM, parallelism_config=ParallelismConfig(
        pp_size=2, pp_schedule=schedule, pp_microbatches=micro))


def _seq_with_loss():
    return pipeline_loss(_seq(), nn.functional.mse_loss)


# -- 2 processes ---------------------------------------------------------------------------------
def check_sequential_batches_of_any_size_equal_one_process():
    """Batches of 3 (fewer samples than the 4 microbatches), 8, 7 (not a multiple of 4) and 2 samples."""
    if _world() != 2:
        return "skipped"
    batches = _seq_batches([3, 8, 7, 2])
    ref = _reference(_seq, batches, _seq_ref)
    return {s: _compared(_train(_pp(s), _seq_with_loss(), batches, _seq_forward), ref)
            for s in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")}


def check_llama_padded_batches_equal_one_process():
    """Right-padded batches with their attention_mask, -100 spread unevenly over the microbatches, rows and
    lengths changing: the loss is the token mean over the whole batch, as ``model(**batch).loss``."""
    if _world() != 2:
        return "skipped"
    batches = _lm_batches()
    ref = _reference(_llama, batches, _lm_ref)
    out = {s: _compared(_train(_pp(s), _llama(), batches, _lm_forward), ref)
           for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")}
    # What a mean of the microbatches' token means would have given instead (batch 0: one row a microbatch).
    first, model = batches[0], _llama()
    logits = model(input_ids=first["input_ids"]).logits
    means = [model.loss_function(logits[i:i + 1], first["labels"][i:i + 1], 64) for i in range(4)]
    out["mean_of_means_would_differ_by"] = abs(float(torch.stack(means).mean()) - ref[0][0])
    return out


def check_eval_of_uneven_batches_gives_their_rows():
    """Under torch.no_grad(): a batch of 8 then one of 3 (Sequential), and a padded LM batch after a longer one:
    the predictions of the batch's own rows (and tokens), equal to one process."""
    if _world() != 2:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="1F1B", pp_microbatches=MICRO))
    model, ref = acc.prepare(_seq_with_loss()), _seq()
    model.eval()
    out = {}
    with torch.no_grad():
        for x, y in _seq_batches([8, 3]):
            res = model(x, labels=y)
            out[f"seq_{x.shape[0]}"] = {"shape": list(res.logits.shape),
                                        "logits": float((res.logits - ref(x)).abs().max()),
                                        "loss": abs(float(res.loss) - float(_seq_ref(ref, (x, y))))}
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="1F1B", pp_microbatches=MICRO))
    model, ref = acc.prepare(_llama()), _llama()
    model.eval()
    with torch.no_grad():
        for batch in _lm_batches()[1:3]:
            res, one = model(**batch), ref(**batch)
            real = batch["attention_mask"].bool()  # padding positions are not masked here, and count nowhere
            out[f"lm_{list(batch['labels'].shape)}"] = {
                "shape": list(res.logits.shape), "logits": float((res.logits - one.logits)[real].abs().max()),
                "loss": abs(float(res.loss) - float(one.loss))}
    for name, r in out.items():
        assert r["logits"] < TOL and r["loss"] < TOL, (name, r)
    return out


def _refused(model, **batch):
    try:
        model(**batch)
    except ValueError as error:
        return str(error)
    raise AssertionError(f"accepted: {sorted(batch)}")


def check_left_padding_and_scored_padding_are_refused():
    """What cannot equal one process without the mask on every stage is refused on every process, before any
    send; the next good batch then trains as one process."""
    if _world() != 2:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="1F1B", pp_microbatches=2))
    model = acc.prepare(_llama())
    g = torch.Generator().manual_seed(8)
    good = _lm_batch(g, 2, 6, [6, 4])
    left = {k: v.flip(1) for k, v in good.items()}  # the same rows, padded on the left
    scored = dict(good, labels=good["input_ids"].clone())  # labels predicted from padding are not -100
    messages = {"left": _refused(model, **left), "scored": _refused(model, **scored)}
    out = model(**good)
    acc.backward(out.loss)
    messages["after"] = abs(float(out.loss) - float(_llama()(**good).loss))
    return messages


# -- 4 processes ---------------------------------------------------------------------------------
def _replica_batches(acc, batch):
    """Every replica's batch of this step, in replica order (what one process reads as the global batch)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (acc.strategy.mesh.data_parallel().rank, [t.clone() for t in batch]))
    mine = {}
    for replica, tensors in parts:
        mine.setdefault(replica, tensors)
    return tuple(torch.cat([mine[r][i] for r in sorted(mine)]) for i in range(len(batch)))


def check_pp_times_dp_padded_last_batch_equals_one_process():
    """pp_size=2 x 2 replicas, 22 samples in batches of 6 (pp_microbatches=4 does not divide 6), drop_last=False:
    the loader's even_batches completes replica 1's last batch of 4 with samples 0 and 1; the run equals one
    process on both replicas' batches, those repeats included."""
    if _world() != 4:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, dp_replicate_size=2, pp_schedule="1F1B",
                                                           pp_microbatches=MICRO))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(22, WIDTH, generator=g)
    model = _seq_with_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sin()), batch_size=6))
    losses, norms, seen = [], [], []
    for batch in loader:
        seen.append(_replica_batches(acc, batch))
        res = model(batch[0], labels=batch[1])
        acc.backward(res.loss)
        losses.append(float(res.loss))
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    params = acc.strategy.model_state_dict(model, everyone=True)
    ref = _seq()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_norms = []
    for bx, by in seen:
        _seq_ref(ref, (bx, by)).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        ref_opt.step()
        ref_opt.zero_grad()
    repeated = sum(int(any(torch.equal(row, other) for other in x[:2])) for row in seen[-1][0][6:])
    res = {"steps": len(seen), "sizes": [b[0].shape[0] for b in seen], "repeated": repeated,
           "norm": max(abs(a - b) for a, b in zip(norms, ref_norms)), "param": _worst(params, ref.state_dict())}
    assert res["norm"] < TOL and res["param"] < TOL, res
    return res


def check_pp_times_fsdp2_stages_built_again_mid_accumulation_keep_gradients():
    """pp_size=2 x dp_shard_size=2 (FSDP2): a batch larger than the first one, in the middle of an accumulation,
    builds torch's stages again; torch's shape inference then sets FSDP2 gradients to None, so the gradients
    of the earlier micro-step must survive it (set aside and added back)."""
    if _world() != 4:
        return "skipped"
    reset_state()
    acc = Accelerator(gradient_accumulation_steps=ACCUM, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                      parallelism_config=ParallelismConfig(pp_size=2, dp_shard_size=2, pp_schedule="1F1B",
                                                           pp_microbatches=2))
    replica = acc.strategy.mesh.data_parallel().rank
    pairs = _seq_batches([2, 2, 6, 6, 4, 4, 2, 2], seed=4)  # each micro-step: replica 0's batch, replica 1's
    got = _train(acc, _seq_with_loss(), pairs[replica::2], _seq_forward, gather=lambda named: _merged(
        {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in named.items()}))
    glob = [tuple(torch.cat([a[i], b[i]]) for i in range(2)) for a, b in zip(pairs[::2], pairs[1::2])]
    # each replica's loss is its own batch's: their mean (equal sizes) is the one-process loss
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, got[0])
    losses = [sum(values) / len(values) for values in zip(*parts)]
    return _compared((losses,) + got[1:], _reference(_seq, glob, _seq_ref))
