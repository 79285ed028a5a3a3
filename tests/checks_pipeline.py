"""Pipeline parallelism on real gloo processes (see distributed.py and test_pipeline.py).

Run on 2 processes (pp_size=2). Each check trains the same model on the same global batches with
one schedule and compares, on every rank, with a one-process reference computed locally: the
loss of every micro-step, the gradients of the first update (gathered from both stages under
their original names), the clipped norm, and the parameters after 3 AdamW updates with
gradient accumulation 2 and ``clip_grad_norm_``.
"""

import os

import torch
import torch.distributed as dist
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.pipeline import pipeline_loss
from hasten.utils.parallelism_config import ParallelismConfig

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
WIDTH, SAMPLES, BATCH, MICRO, ACCUM, STEPS, CLIP = 8, 48, 8, 4, 2, 3, 0.5


def _seq() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _seq_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    return torch.utils.data.TensorDataset(x, x.sin())


def _lm_data():
    """Token ids and labels with -100 holes of varying count, so microbatches hold unequal numbers of tokens."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (BATCH * ACCUM * STEPS // 2, 8), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.3] = -100
    return torch.utils.data.TensorDataset(ids, labels)


def _accelerator(schedule: str, handlers=None, precision: str = "no") -> Accelerator:
    reset_state()
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=ACCUM, kwargs_handlers=handlers,
                       parallelism_config=ParallelismConfig(pp_size=2, pp_schedule=schedule, pp_microbatches=MICRO))


def _gather(named: dict) -> dict:
    """Every rank's ``{name: tensor}`` merged (the stages hold disjoint names)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach().cpu().clone() for k, v in named.items()})
    out = {}
    for part in parts:
        assert not set(part) & set(out), sorted(set(part) & set(out))
        out.update(part)
    return out


def _worst(got: dict, ref: dict) -> float:
    assert set(got) == set(ref), (sorted(set(got) ^ set(ref)))
    return max(float((got[k] - ref[k]).abs().max()) for k in ref)


def _reference(make, batches, loss_of, eps=1e-8):
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps)
    losses, norms, grads = [], [], None
    for i, batch in enumerate(batches):
        loss = loss_of(model, batch)
        (loss / ACCUM).backward()
        losses.append(float(loss))
        if (i + 1) % ACCUM == 0:
            if grads is None:
                grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
    return losses, norms, grads, {k: v.clone() for k, v in model.state_dict().items()}


def _pipelined(schedule, make, data, batch_size, forward, loss_fn=None, handlers=None, precision="no"):
    acc = _accelerator(schedule, handlers, precision)
    model = make()
    if loss_fn is not None:
        pipeline_loss(model, loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=batch_size))
    assert type(acc.strategy).__name__ == "PipelineStrategy"
    losses, norms, grads = train_loop(acc, model, opt, loader, forward)
    params = acc.strategy.model_state_dict(model, everyone=True)
    return acc, model, losses, norms, grads, params


def train_loop(acc, model, opt, batches, forward, gather=_gather, each_step=None) -> tuple:
    """The four-line loop with accumulation and clipping over ``batches`` of a prepared pipelined ``model``:
    the losses, the clipped norms and the first update's gradients (``gather``-ed over the stages);
    ``each_step(model)`` after each backward."""
    losses, norms, grads = [], [], None
    for batch in batches:
        with acc.accumulate(model):
            out = forward(model, batch)
            acc.backward(out.loss)
            losses.append(float(out.loss))
            if each_step is not None:
                each_step(model)
            if acc.sync_gradients:
                if grads is None:
                    grads = gather({k: p.grad for k, p in model.named_stage_parameters()})
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
    return losses, norms, grads


def _compare(schedule, make, data, batch_size, forward, ref_loss, loss_fn=None, handlers=None):
    acc, model, losses, norms, grads, params = _pipelined(schedule, make, data, batch_size, forward, loss_fn, handlers)
    batches = list(torch.utils.data.DataLoader(data, batch_size=batch_size))
    ref_losses, ref_norms, ref_grads, ref_params = _reference(make, batches, ref_loss)
    assert len(losses) == len(ref_losses) == ACCUM * STEPS, (losses, ref_losses)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    norm_diff = max(abs(a - b) for a, b in zip(norms, ref_norms))
    grad_diff, param_diff = _worst(grads, ref_grads), _worst(params, ref_params)
    assert loss_diff < 1e-5 and norm_diff < 1e-5, (losses, ref_losses, norms, ref_norms)
    assert grad_diff < 1e-5 and param_diff < 1e-5, (grad_diff, param_diff)
    stages = [s for s, _ in model.local_stages()]
    wrapped = sum(type(m).__name__ == "CheckpointWrapper" for _, stage in model.local_stages() for m in stage.modules())
    return {"wrapped": wrapped, "loss": loss_diff, "norm": norm_diff, "grad": grad_diff, "param": param_diff, "stages": stages,
            "names": sorted(k for k, _ in model.named_stage_parameters())}


def _seq_forward(model, batch):
    return model(batch[0], labels=batch[1])


def _seq_ref(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _lm_forward(model, batch):
    return model(input_ids=batch[0], labels=batch[1])


def _lm_ref(model, batch):
    return model(input_ids=batch[0], labels=batch[1]).loss


def _each_schedule(schedules, make, data, batch_size, forward, ref_loss, loss_fn=None):
    return {s: _compare(s, make, data, batch_size, forward, ref_loss, loss_fn) for s in schedules}


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])


def check_sequential_each_schedule_equals_one_process():
    if _world() != 2:
        return "skipped"
    return _each_schedule(SCHEDULES + ("LoopedBFS", "DualPipeV"), _seq, _seq_data(), BATCH, _seq_forward, _seq_ref, nn.functional.mse_loss)


def check_llama_each_schedule_equals_one_process():
    if _world() != 2:
        return "skipped"
    return _each_schedule(SCHEDULES, _llama, _lm_data(), BATCH // 2, _lm_forward, _lm_ref)


def check_llama_split_points_and_logits():
    if _world() != 2:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="GPipe", pp_microbatches=2,
                                                           pp_split_points=["model.layers.1"]))
    original = _llama()
    model = acc.prepare(original)
    local = {id(p) for _, p in model.named_stage_parameters()}
    assert all((p.numel() > 0) == (id(p) in local) for p in original.parameters())  # other stages: released
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    out = model(input_ids=ids, labels=ids)
    acc.backward(out.loss)
    ref = _llama()(input_ids=ids, labels=ids)
    logits = None if out.logits is None else float((out.logits - ref.logits).abs().max())
    assert abs(float(out.loss) - float(ref.loss)) < 1e-5, (float(out.loss), float(ref.loss))
    full = acc.get_state_dict(model)  # every stage gathered, under the original names
    assert _worst(full, _llama().state_dict()) == 0.0
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], "pp_model")
    acc.save_model(model, folder)  # every process gathers; process 0 writes the full model's file
    acc.wait_for_everyone()
    from safetensors.torch import load_file

    saved = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            saved.update(load_file(os.path.join(folder, name)))
    assert _worst(saved, _llama().state_dict()) == 0.0
    # save_state: each process writes its stages' DCP shards (the original names); a fresh run reads them back
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], "pp_ckpt")
    acc.save_state(folder)
    saved_here = {k: v.detach().clone() for k, v in model.stage_state_dict().items()}
    with torch.no_grad():
        for _, p in model.named_stage_parameters():
            p.zero_()
    acc.load_state(folder)
    restored = all(torch.equal(v, saved_here[k]) for k, v in model.stage_state_dict().items())
    return {"names": sorted(k for k, _ in model.named_stage_parameters()), "logits": logits, "restored": restored}


def check_changed_loss_is_refused():
    if _world() != 2:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="1F1B", pp_microbatches=2))
    model = _seq()
    pipeline_loss(model, nn.functional.mse_loss)
    model = acc.prepare(model)
    x = torch.randn(4, WIDTH)
    out = model(x, labels=x)
    try:
        acc.backward(out.loss * 2)
    except ValueError as error:
        return str(error)
    raise AssertionError("a scaled loss was accepted")


def check_too_few_layers_is_refused():
    if _world() != 2:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="Interleaved1F1B", pp_microbatches=4))
    model = _seq()[:3]
    pipeline_loss(model, nn.functional.mse_loss)
    try:
        acc.prepare(model)
    except ValueError as error:
        return str(error)
    raise AssertionError("3 layers over 4 stages were accepted")



def check_sequential_without_a_loss_is_refused():
    if _world() != 2:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2))
    try:
        acc.prepare(_seq())
    except ValueError as error:
        return str(error)
    raise AssertionError("an nn.Sequential without pipeline_loss was accepted")


def check_eval_under_no_grad_changes_no_gradient():
    if _world() != 2:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="1F1B", pp_microbatches=2))
    model = acc.prepare(_llama())
    model.eval()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    ref = _llama()(input_ids=ids, labels=ids).loss
    assert all(p.grad is None for _, p in model.named_stage_parameters())
    try:
        acc.backward(out.loss)
    except ValueError as error:
        assert "torch.no_grad()" in str(error), str(error)
    else:
        raise AssertionError("backward of a no_grad loss was accepted")
    return abs(float(out.loss) - float(ref))


def check_pp_times_dp_equals_one_process():
    """4 processes: 2 replicas x 2 stages; replica r reads every other batch, as DDP would."""
    if _world() != 4:
        return "skipped"
    out = {}
    for schedule in ("1F1B", "Interleaved1F1B"):
        reset_state()
        acc = Accelerator(gradient_accumulation_steps=ACCUM, parallelism_config=ParallelismConfig(
            pp_size=2, dp_replicate_size=2, pp_schedule=schedule, pp_microbatches=MICRO))
        model = _seq()
        pipeline_loss(model, nn.functional.mse_loss)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = _seq_data()
        model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=BATCH // 2))
        losses, norms = [], []
        for x, y in loader:
            with acc.accumulate(model):
                res = model(x, labels=y)
                acc.backward(res.loss)
                losses.append(float(res.loss))
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                opt.step()
                opt.zero_grad()
        params = acc.strategy.model_state_dict(model, everyone=True)
        pairs = list(torch.utils.data.DataLoader(data, batch_size=BATCH // 2))
        batches = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(pairs[::2], pairs[1::2])]
        _, ref_norms, _, ref_params = _reference(_seq, batches, _seq_ref)
        norm_diff = max(abs(a - b) for a, b in zip(norms, ref_norms))
        param_diff = _worst(params, ref_params)
        assert len(norms) == len(ref_norms) == STEPS and norm_diff < 1e-5 and param_diff < 1e-5, (norms, ref_norms)
        out[schedule] = {"norm": norm_diff, "param": param_diff, "replica": acc.strategy.mesh.data_parallel().rank}
    return out


def _bf16_lm_ref(model, batch):
    with torch.autocast(batch[0].device.type, dtype=torch.bfloat16):  # what Precision("bf16") puts around a forward
        return model(input_ids=batch[0], labels=batch[1]).loss.float()


def check_bf16_equals_one_process_bf16():
    """mixed_precision="bf16": autocast on each stage's forward; compared with one process under autocast."""
    if _world() != 2:
        return "skipped"
    data = _lm_data()
    _, _, losses, norms, grads, params = _pipelined("1F1B", _llama, data, BATCH // 2, _lm_forward, precision="bf16")
    batches = list(torch.utils.data.DataLoader(data, batch_size=BATCH // 2))
    ref_losses, ref_norms, ref_grads, ref_params = _reference(_llama, batches, _bf16_lm_ref)
    fp32_losses = _reference(_llama, batches, _lm_ref)[0]
    res = {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
           "norm": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
           "grad": max(float((grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()) for k in ref_grads),
           "param": _worst(params, ref_params),
           "bf16_vs_fp32_loss": max(abs(a - b) for a, b in zip(ref_losses, fp32_losses)),
           "first_update_loss": max(abs(a - b) for a, b in zip(losses[:ACCUM], ref_losses[:ACCUM])),
           "first_norm": abs(norms[0] - ref_norms[0]) / ref_norms[0]}
    # The forward is the one-process bf16 forward exactly (losses before the first update agree to 1e-5);
    # the weight gradients differ by bf16 rounding (each microbatch's bf16 matmul gradient is rounded, then
    # summed in fp32, instead of one rounding of the whole batch's): within 2**-7 of each tensor's largest.
    assert res["first_update_loss"] < 1e-5 and res["grad"] < 2 ** -7 and res["first_norm"] < 2 ** -7, res
    assert res["loss"] < 1e-2 and res["param"] < 5e-2, res  # after AdamW steps on those gradients
    return res


def check_fp16_is_refused():
    if _world() != 2:
        return "skipped"
    reset_state()
    try:
        Accelerator(mixed_precision="fp16", parallelism_config=ParallelismConfig(pp_size=2))
    except ValueError as error:
        return str(error)
    raise AssertionError("fp16 under pipeline parallelism was accepted")


def check_activation_checkpointing_equals_one_process():
    """The checkpoint wrappers go around each stage's blocks (the layout steps run per stage): the numbers
    are the one-process loop's, names stay the model's own."""
    if _world() != 2:
        return "skipped"
    from hasten.utils import ActivationCheckpointingKwargs

    out = {}
    for schedule in ("1F1B", "Interleaved1F1B"):
        out[f"llama {schedule}"] = _compare(schedule, _llama, _lm_data(), BATCH // 2, _lm_forward, _lm_ref,
                                            handlers=[ActivationCheckpointingKwargs()])
    out["sequential every_k"] = _compare("1F1B", _seq, _seq_data(), BATCH, _seq_forward, _seq_ref, nn.functional.mse_loss,
                                         handlers=[ActivationCheckpointingKwargs(mode="every_k", every=2)])
    return out
