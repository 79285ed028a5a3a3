"""Sequences split over 2 real processes (see distributed.py and test_sequence_split.py): context
parallelism (cp, torch's ring attention; on the CPU with the CPU kernel) and Ulysses sequence
parallelism (sp, all-to-all over heads), each against one process on the same batch."""

import torch

from distributed import reset_state
from hasten import Accelerator
from hasten.utils import ParallelismConfig
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

VOCAB, SEQ, BATCH, STEPS = 64, 16, 2, 3


def _model(heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _batch(step: int, device) -> tuple:
    """Input ids, position ids and labels shifted before any split; a few labels are -100 so the
    processes hold different numbers of tokens (the loss must still be the all-token mean)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    labels[0, 1:4] = -100  # in the first chunk only: unequal token counts across processes
    positions = torch.arange(SEQ).expand(BATCH, SEQ).clone()
    return ids.to(device), positions.to(device), labels.to(device)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _reference(device, optimizer=None) -> dict:
    """One process: the plain model on the whole batch, 3 AdamW steps (or ``optimizer(parameters)``)."""
    model = _model().to(device)
    opt = (optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3)))(model.parameters())
    losses, grads = [], None
    for step in range(STEPS):
        ids, pos, labels = _batch(step, device)
        loss = model(input_ids=ids, position_ids=pos, labels=labels, shift_labels=labels).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def split_step(acc: Accelerator, model, ids, positions, labels) -> tuple:
    """Forward and backward of one batch whose sequences are split over the cp/sp processes (the buffers
    are cut in place, each process keeping its half), the loss the mean over all labelled tokens."""
    length = ids.shape[1]
    with acc.maybe_context_parallel(buffers=[ids, positions, labels], buffer_seq_dims=[1, 1, 1],
                                    no_restore_buffers={ids, positions, labels}):
        assert ids.shape[1] == length // 2  # this process's part of each sequence
        out = model(input_ids=ids, position_ids=positions, labels=labels, shift_labels=labels)
        loss = acc.loss_over_sequence(out.loss, (labels != -100).sum())
        acc.backward(loss)
    return out, loss


def _split_run(acc: Accelerator) -> dict:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    inner = acc.unwrap_model(model)
    losses, grads = [], None
    for step in range(STEPS):
        ids, pos, labels = _batch(step, acc.device)
        _, loss = split_step(acc, model, ids, pos, labels)
        if step == 0:
            grads = {n: _full(p.grad).detach().clone() for n, p in inner.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "grads": grads,
            "params": {n: _full(p.data).detach().clone() for n, p in inner.named_parameters()},
            "attn": inner.config._attn_implementation}


def _compare(acc: Accelerator) -> dict:
    got = _split_run(acc)
    want = _reference(acc.device)
    worst = lambda a, b: max(float((a[n].to(b[n].device) - b[n]).abs().max()) for n in b)  # noqa: E731
    return {"loss": max(abs(a - b) for a, b in zip(got["losses"], want["losses"])),
            "grads": worst(got["grads"], want["grads"]), "params": worst(got["params"], want["params"]),
            "losses": got["losses"], "attn": got["attn"]}


def check_cp2_equals_one_process():
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(cp_size=2), fsdp_plugin=Plugin(fsdp_version=2))
    return _compare(acc)


def check_sp2_ddp_equals_one_process():
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(sp_size=2))
    return {**_compare(acc), "strategy": type(acc.strategy).__name__, "sp_rank": acc.sequence_parallel_rank}


def check_sp2_fsdp2_equals_one_process():
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(sp_size=2), fsdp_plugin=Plugin(fsdp_version=2))
    return {**_compare(acc), "strategy": type(acc.strategy).__name__}


def _refusal(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as error:
        return str(error)
    raise AssertionError("no error")


def check_refusals():
    """Bad sp/cp layouts named in one line at prepare or in the loop."""
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(sp_size=2))
    out = {"heads": _refusal(lambda: acc.prepare(_model(heads=1, kv_heads=1)))}
    model = acc.prepare(_model())
    ids, pos, labels = _batch(0, acc.device)
    out["outside"] = _refusal(lambda: model(input_ids=ids, position_ids=pos))
    odd = ids[:, :15].clone()

    def uneven():
        with acc.maybe_context_parallel(buffers=[odd], buffer_seq_dims=[1]):
            pass
    out["length"] = _refusal(uneven)

    def padded():
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        with acc.maybe_context_parallel(buffers=[ids, pos, mask], buffer_seq_dims=[1, 1, 1]):
            model(input_ids=ids, position_ids=pos, attention_mask=mask)
    out["mask"] = _refusal(padded)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    out["plain"] = _refusal(lambda: acc.prepare(plain))
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(cp_size=2), fsdp_plugin=Plugin(fsdp_version=2))
    short = ids[:, :6].clone()

    def unbalanced():
        with acc.maybe_context_parallel(buffers=[short], buffer_seq_dims=[1]):
            pass
    out["cp_length"] = _refusal(unbalanced)
    return out
