"""Pipeline parallelism composed with FSDP2, tensor parallelism, replicas (eval, no_sync), on 4 real
gloo processes (see distributed.py and test_pipeline_compose.py). Every check compares with one
process on the same global batches: losses, the first update's gradients, the clipped norms and the
parameters after 3 AdamW steps (gradient accumulation 2, clip_grad_norm_)."""

import os

import torch
import torch.distributed as dist
from torch import nn

from checks_pipeline import ACCUM, CLIP, MICRO, _llama, _reference, _seq, _seq_data, _seq_ref, _worst
from distributed import reset_state
from hasten import Accelerator
from hasten.pipeline import pipeline_loss
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin
from hasten.utils.parallelism_config import ParallelismConfig

TOL = 1e-5


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _merged(named: dict) -> dict:
    """Every rank's ``{name: tensor}`` merged (replicas and shards hold the same names: equal values)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach().cpu().clone() for k, v in named.items()})
    out = {}
    for part in parts:
        for k, v in part.items():
            if k in out:
                assert torch.equal(out[k], v), k
            out[k] = v
    return out


def _lm_full_data(n):
    """Token ids, labels equal (no -100): every replica's batch counts the same tokens, so the replicas'
    mean of token means is the one-process token mean."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (n, 8), generator=g)
    return torch.utils.data.TensorDataset(ids, ids.clone())


def _train(acc, make, data, batch, loss_fn=None, eps=1e-8):
    model = make()
    if loss_fn is not None:
        pipeline_loss(model, loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=batch))
    losses, norms, grads = [], [], None
    for x, y in loader:
        with acc.accumulate(model):
            out = model(x, labels=y)
            acc.backward(out.loss)
            losses.append(float(out.loss))
            if acc.sync_gradients:
                if grads is None:
                    grads = _merged({k: _full(p.grad) for k, p in model.named_stage_parameters()})
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
    params = acc.strategy.model_state_dict(model, everyone=True)
    return model, losses, norms, grads, params


def _compare(acc, make, data, batch, replicas, ref_loss, loss_fn=None, eps=1e-8):
    """``eps``: AdamW's; its step divides by ``sqrt(v) + eps``, so a gradient element near ``eps`` turns a float32
    rounding difference of the gradient into a parameter difference up to ``lr / eps`` times larger."""
    model, losses, norms, grads, params = _train(acc, make, data, batch, loss_fn, eps)
    losses = _replicas_mean(losses)
    ref_losses, ref_norms, ref_grads, ref_params = _reference(make, _global_batches(data, batch, replicas), ref_loss, eps)
    diffs = {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
             "norm": max(abs(a - b) for a, b in zip(norms, ref_norms)),
             "grad": _worst(grads, ref_grads), "param": _worst(params, ref_params)}
    assert len(losses) == len(ref_losses) and len(norms) == len(ref_norms) == 3, (losses, ref_losses)
    assert all(v < TOL for v in diffs.values()), diffs
    diffs["kinds"] = sorted({type(p).__name__ for _, p in model.named_stage_parameters()})
    diffs["stages"] = [s for s, _ in model.local_stages()]
    return diffs


def _replicas_mean(losses: list) -> list:
    """The loss every process reports is its replica's; the one-process loss is the replicas' mean."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    return [sum(col) / len(col) for col in zip(*every)]


def _global_batches(data, batch: int, replicas: int) -> list:
    """The one-process batches: ``replicas`` consecutive batches of ``batch`` samples (one per replica) joined."""
    parts = list(torch.utils.data.DataLoader(data, batch_size=batch))
    return [tuple(torch.cat([p[i] for p in parts[k:k + replicas]]) for i in range(2))
            for k in range(0, len(parts), replicas)]


def _lm_ref(model, batch):
    return model(input_ids=batch[0], labels=batch[1]).loss


def check_pp_fsdp2_equals_one_process():
    """pp_size=2 x dp_shard_size=2 (FSDP2): each stage's blocks fully_shard-ed over its dp_shard pair."""
    if _world() != 4:
        return "skipped"
    out = {}
    for name, make, data, batch, ref, fn in (("sequential", _seq, _seq_data(), 4, _seq_ref, nn.functional.mse_loss),
                                             ("llama", _llama, _lm_full_data(24), 2, _lm_ref, None)):
        reset_state()
        acc = Accelerator(gradient_accumulation_steps=ACCUM, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                          parallelism_config=ParallelismConfig(pp_size=2, dp_shard_size=2, pp_schedule="1F1B",
                                                               pp_microbatches=2))
        assert type(acc.strategy).__name__ == "PipelineStrategy"
        out[name] = _compare(acc, make, data, batch, 2, ref, fn)
    return out


def check_pp_tp_equals_one_process():
    """pp_size=2 x tp_size=2: the model's tensor-parallel plan on each stage; both tp ranks read the same batches."""
    if _world() != 4:
        return "skipped"
    reset_state()
    acc = Accelerator(gradient_accumulation_steps=ACCUM, parallelism_config=ParallelismConfig(
        pp_size=2, tp_size=2, pp_schedule="1F1B", pp_microbatches=2))
    res = _compare(acc, _llama, _lm_full_data(12), 2, 1, _lm_ref)

    return res


def check_eval_gather_for_metrics_and_no_sync():
    """pp_size=2 x dp_replicate_size=2: eval predictions of every replica on every process; no_sync as DDP's."""
    if _world() != 4:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, dp_replicate_size=2, pp_schedule="1F1B",
                                                           pp_microbatches=2))
    model = _seq()
    pipeline_loss(model, nn.functional.mse_loss)
    data = _seq_data()
    evaluation = torch.utils.data.TensorDataset(data.tensors[0][:10], data.tensors[1][:10])  # 10: an uneven end
    model, loader = acc.prepare(model, torch.utils.data.DataLoader(evaluation, batch_size=2))
    model.eval()
    preds = []
    with torch.no_grad():
        for x, y in loader:
            out = model(x, labels=y)
            preds.append(acc.gather_for_metrics(out.logits))
    preds = torch.cat(preds)
    pred_diff = float((preds - _seq()(evaluation.tensors[0])).abs().max())
    assert preds.shape == (10, 8) and pred_diff < TOL, (preds.shape, pred_diff)
    # no_sync: a step inside keeps each replica's own gradients; the next step outside averages the sums
    model.train()
    x, y = data.tensors[0][:8], data.tensors[1][:8]
    r = acc.strategy.mesh.data_parallel().rank
    mine = lambda k: (x[4 * k:4 * k + 4][2 * r:2 * r + 2], y[4 * k:4 * k + 4][2 * r:2 * r + 2])  # noqa: E731
    with acc.no_sync(model):
        res = model(*mine(0)[:1], labels=mine(0)[1])
        acc.backward(res.loss)
    inside = _merged_per_rank({k: p.grad for k, p in model.named_stage_parameters()})
    res = model(*mine(1)[:1], labels=mine(1)[1])
    acc.backward(res.loss)
    after = _merged({k: p.grad for k, p in model.named_stage_parameters()})  # asserts the replicas agree
    ref = _seq()
    for k in range(2):
        _seq_ref(ref, (x[4 * k:4 * k + 4], y[4 * k:4 * k + 4])).backward()
    grad_diff = _worst(after, {k: p.grad for k, p in ref.named_parameters()})
    assert inside and grad_diff < TOL, grad_diff
    return {"preds": pred_diff, "grad": grad_diff, "replicas_differ_inside": inside}


def _merged_per_rank(named: dict) -> bool:
    """Whether the two replicas of this stage hold different gradients (as under DDP's no_sync)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach().cpu().clone() for k, v in named.items()})
    me = dist.get_rank()
    other = me ^ 1  # pp outermost: ranks 0, 1 are stage 0's two replicas
    return any(not torch.equal(parts[me][k], parts[other][k]) for k in parts[me])
