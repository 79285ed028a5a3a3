"""Expert parallelism inside each rank (see distributed.py and test_expert_parallel.py).

Run on 2 processes (ep=2 over dp_shard=2: every process holds half the experts, FSDP2 shards the
rest) and on 4 (ep=2 x dp_shard=4: the experts also FSDP-sharded over the 2 processes holding the same
experts). The reference is the same model trained on one process with the whole batch, computed in
each rank; the router's auxiliary loss counts (0.1 x) in every loss compared.
"""

import os

import torch
from torch import nn

from checks_sequence_split import split_step
from distributed import reset_state
from hasten import Accelerator
from hasten.activation_checkpointing import strip_checkpoint_prefix
from hasten.strategies.expert_parallel import expert_modules
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin
from hasten.utils.parallelism_config import ParallelismConfig

VOCAB, SEQ, PER_RANK, STEPS, CLIP, LR = 64, 8, 2, 3, 0.5, 0.01
# AdamW's eps in the tp and cp checks. Some gradients there are ~5e-9 (lm_head rows, q_proj entries) and
# differ from one process's by 1e-10..1e-9 (another summation order; ring attention's log-sum-exp merge);
# next to the default eps 1e-8 Adam divides by about the gradient itself and turns that into 1e-5..1e-4 of
# weight after one step (lr 0.01). With 1e-5 the same gradients move the weights by < 1e-6.
SPLIT_EPS = 1e-5


def _qwen3_moe(experts: int = 4, moe_intermediate: int = 16) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=moe_intermediate,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=experts,
                         num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
                         max_position_embeddings=32)
    return Qwen3MoeForCausalLM(cfg)


def _mixtral(experts: int = 4) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2,
                        output_router_logits=True, router_aux_loss_coef=0.1, max_position_embeddings=32)
    return MixtralForCausalLM(cfg)


class PlainMoE(nn.Module):
    """A plain PyTorch MoE block: a router and an experts module of the documented contract."""

    def __init__(self, dim: int = 8, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = PlainExperts(dim, experts)
        self.head = nn.Linear(dim, 1)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        return self.head(torch.tanh(x + self.experts(x, index, weights)))


class PlainExperts(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.up = nn.Parameter(torch.randn(experts, dim, 2 * dim) * 0.3)
        self.down = nn.Parameter(torch.randn(experts, 2 * dim, dim) * 0.3)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for slot in range(top_k_index.shape[1]):
            for e in range(self.num_experts):  # local ids under expert parallelism
                rows = (top_k_index[:, slot] == e).nonzero().flatten()
                if rows.numel():
                    y = torch.relu(x[rows] @ self.up[e]) @ self.down[e]
                    out = out.index_add(0, rows, y * top_k_weights[rows, slot, None])
        return out


def _batches(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (PER_RANK * world, SEQ), generator=g) for _ in range(STEPS)]


def _next_tokens(x: torch.Tensor) -> torch.Tensor:
    """Labels already shifted (the next token), so that a split sequence keeps its labels; the last
    position's and three of the first row's are -100, so that the processes of a cp/sp group hold
    different numbers of labelled tokens (the loss must still be the all-token mean, and the router's
    loss must not be weighted by those numbers)."""
    labels = torch.roll(x, -1, dims=1)
    labels[:, -1] = -100
    labels[0, 1:4] = -100
    return labels


def _reference(batches, build, shifted: bool = False, eps: float = 1e-8, lr: float = LR):
    """One process, the whole batch: losses, aux losses, clip norms, first gradients, final weights.
    ``shifted``: labels given already shifted (``_next_tokens``, as a split sequence needs them)."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    losses, aux, norms, grads = [], [], [], None
    for x in batches:
        out = model(input_ids=x, labels=_next_tokens(x), shift_labels=_next_tokens(x)) if shifted else \
            model(input_ids=x, labels=x)
        out.loss.backward()
        losses.append(float(out.loss))
        aux.append(float(out.aux_loss.detach()) if out.aux_loss is not None else 0.0)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"loss": losses, "aux": aux, "norm": norms, "grads": grads,
            "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _mean(acc, value: torch.Tensor) -> float:
    return float(acc.reduce(value.detach().reshape(1), reduction="mean"))


def _step(acc, model, mine: torch.Tensor, split: bool):
    """Forward and backward of this data-parallel rank's rows; ``split``: each cp/sp process its part of
    every sequence, the loss the mean over all tokens (``loss_over_sequence``)."""
    if not split:
        out = model(input_ids=mine, labels=mine)
        acc.backward(out.loss)
        return out, out.loss
    positions = torch.arange(mine.shape[1], device=mine.device).expand_as(mine).clone()
    return split_step(acc, model, mine, positions, _next_tokens(mine))


def _train_ep(acc, build=_qwen3_moe, split: bool = False, eps: float = 1e-8, lr: float = LR):
    """3 AdamW steps with clipping: each data-parallel rank its rows of the global batch (the tp processes
    of one copy the same rows), compared with one process on the whole batch. ``eps``: AdamW's (``SPLIT_EPS``
    for tp and cp: see there)."""
    data = acc.strategy.mesh.data_parallel()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    model, opt = acc.prepare(model, opt)
    batches = _batches(data.size)
    losses, aux, norms, grads = [], [], [], None
    for x in batches:
        mine = x[data.rank * PER_RANK:(data.rank + 1) * PER_RANK].clone().to(acc.device)  # cp/sp cut it in place
        out, loss = _step(acc, model, mine, split)
        losses.append(_mean(acc, loss))
        aux.append(float(out.aux_loss.detach()))  # the whole batch's, the same on every process
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        if grads is None:  # after clipping, as in the reference
            grads = {strip_checkpoint_prefix(n): _full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    ref = _reference(batches, build, shifted=split, eps=eps, lr=lr)
    weights = acc.strategy.model_state_dict(model, everyone=True)
    worst = {
        "loss": max(abs(a - b) for a, b in zip(losses, ref["loss"])),
        "aux": max(abs(a - b) for a, b in zip(aux, ref["aux"])),
        "norm": max(abs(a - b) for a, b in zip(norms, ref["norm"])),
        "grads": max(float((grads[n] - ref["grads"][n]).abs().max()) for n in ref["grads"]),
        "weights": max(float((weights[k].cpu() - ref["weights"][k]).abs().max()) for k in ref["weights"]),
    }
    assert set(grads) == set(ref["grads"]), sorted(set(grads) ^ set(ref["grads"]))
    experts = expert_modules(model)[0]  # the first layer's
    return model, opt, {"worst": worst, "aux": aux, "ref_aux": ref["aux"], "class": type(experts).__name__,
                        "local_experts": experts.num_experts,
                        "expert_placements": str(experts.gate_up_proj.placements),
                        "expert_mesh": list(experts.gate_up_proj.device_mesh.mesh_dim_names),
                        "local_shape": list(experts.gate_up_proj.to_local().shape)}


def _accelerator(plugin=None, **sizes) -> Accelerator:
    reset_state()
    return Accelerator(parallelism_config=ParallelismConfig(**sizes), fsdp_plugin=plugin or Plugin(fsdp_version=2))


def check_ep_equals_one_process_and_checkpoints():
    """Training equals one process; save_state (DCP) and save_model (one safetensors file) afterwards."""
    world = int(os.environ["WORLD_SIZE"])
    acc = _accelerator(ep_size=2) if world == 2 else _accelerator(dp_shard_size=4, ep_size=2)
    model, opt, report = _train_ep(acc)
    tmp = os.environ["EP_TMP"]
    acc.save_state(os.path.join(tmp, "ep_ckpt"))
    acc.save_model(model, os.path.join(tmp, "ep_model"))
    full = acc.strategy.model_state_dict(model, everyone=True)
    if acc.is_main_process:
        torch.save({k: v.cpu() for k, v in full.items()}, os.path.join(tmp, "ep_weights.pt"))
    acc.wait_for_everyone()
    report["mesh"] = repr(acc.strategy.mesh)
    report["recorded"] = acc.strategy.describe()["mesh"]
    report["opt_state"] = len(opt.state)
    return report


def check_ep_with_hsdp_equals_one_process():
    """ep=2 over dp_shard=2, replicated twice (dp_replicate=2, 4 processes): the experts' mesh is
    (dp_replicate, efsdp); their gradients are averaged over all 4 data-parallel processes."""
    if int(os.environ["WORLD_SIZE"]) != 4:
        return "skipped"
    _, _, report = _train_ep(_accelerator(dp_replicate_size=2, dp_shard_size=2, ep_size=2))
    return report


def check_ep_with_decoder_layers_wrapped_and_checkpointed():
    """FSDP2 per decoder layer (the experts inside, sharded on their own mesh first) and activation
    checkpointing of those layers (the recomputed forward exchanges the tokens again): the same numbers."""
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    plugin = Plugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", activation_checkpointing=True)
    model, _, report = _train_ep(_accelerator(plugin, ep_size=2))
    report["checkpointed"] = sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
    return report


def check_mixtral_ep_equals_one_process():
    """Mixtral's own base_model_ep_plan, the same comparison (2 processes)."""
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    _, _, report = _train_ep(_accelerator(ep_size=2), build=_mixtral)
    return report


def check_ep_borrowing_tp_equals_one_process():
    """tp_size=2 with ep_size=2 on 2 processes: the experts split whole over the tp pair (Mixtral's tp plan
    less its experts keys), each process sending its half of the shared tokens to them."""
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    model, _, report = _train_ep(_accelerator(tp_size=2, ep_size=2), build=_mixtral, eps=SPLIT_EPS)
    report["attention"] = str(model.model.layers[0].self_attn.q_proj.weight.placements)
    return report


def check_qwen3_moe_tp_with_ep_equals_one_process():
    """Qwen3-MoE under its own tp plan (tp_size=2, ep_size=2): its per-head q_norm/k_norm are whole on both
    processes but see half the heads each, so their gradients are summed over tp (GradientSum)."""
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    model, _, report = _train_ep(_accelerator(tp_size=2, ep_size=2), eps=SPLIT_EPS)
    attention = model.model.layers[0].self_attn
    report["attention"] = str(attention.q_proj.weight.placements)
    report["q_norm_local"] = list(attention.q_norm.weight.to_local().shape) if hasattr(
        attention.q_norm.weight, "to_local") else list(attention.q_norm.weight.shape)
    return report


def check_ep_borrowing_cp_equals_one_process():
    """cp_size=2 with ep_size=2: each process its part of every sequence (ring attention), the experts
    split over the cp pair; the loss over all tokens and the router's loss of the whole batch."""
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    # lr 1e-3 (as the sequence-split checks): ring attention's merge leaves 1e-9 differences in tiny gradients
    # that AdamW at lr 0.01 turns into ~1e-5 of weight (embedding rows first used at step 2 or 3).
    return _train_ep(_accelerator(cp_size=2, ep_size=2), split=True, eps=SPLIT_EPS, lr=1e-3)[2]


def check_ep_borrowing_sp_equals_one_process():
    """sp_size=2 (Ulysses) with ep_size=2: the same, the experts split over the sp pair."""
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    return _train_ep(_accelerator(sp_size=2, ep_size=2), split=True)[2]


def check_ep_borrowing_dp_shard_and_tp_equals_one_process():
    """dp_shard_size=2 x tp_size=2 on 4 processes: ep=4 (the experts split over all four: two batches,
    each shared by a tp pair) and ep=2 (over each tp pair; each expert FSDP-sharded over the two
    processes holding it, which hold different tp positions)."""
    if int(os.environ["WORLD_SIZE"]) != 4:
        return "skipped"
    out = {}
    for ep in (4, 2):
        _, _, report = _train_ep(_accelerator(dp_shard_size=2, tp_size=2, ep_size=ep), build=_mixtral, eps=SPLIT_EPS)
        out[f"ep{ep}"] = report
    return out


def check_plain_pytorch_moe_under_a_user_plan():
    """A plain PyTorch MoE, split by ``ep_plan``: equals one process (SGD, clipping, 3 steps)."""
    world = int(os.environ["WORLD_SIZE"])
    if world != 2:
        return "skipped"
    acc = _accelerator(ep_size=2, ep_plan={"experts": "experts"})
    torch.manual_seed(0)
    model = PlainMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(2)
    data = [torch.randn(4 * world, 8, generator=g) for _ in range(STEPS)]
    norms = []
    for x in data:
        mine = x[acc.process_index * 4:(acc.process_index + 1) * 4]
        acc.backward(model(mine).pow(2).mean())
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    torch.manual_seed(0)
    ref = PlainMoE()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_norms = []
    for x in data:
        ref(x).pow(2).mean().backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        ref_opt.step()
        ref_opt.zero_grad()
    got = acc.strategy.model_state_dict(model, everyone=True)
    worst = max(float((got[k].cpu() - v).abs().max()) for k, v in ref.state_dict().items())
    return {"worst": worst, "norms": max(abs(a - b) for a, b in zip(norms, ref_norms)),
            "local": list(model.experts.up.to_local().shape)}


def check_ep_refusals_name_the_fix():
    """ep not dividing the experts, ep without FSDP2: one line each, before any expert moves."""
    world = int(os.environ["WORLD_SIZE"])
    if world != 2:
        return "skipped"
    out = {}
    acc = _accelerator(ep_size=2)
    try:
        acc.prepare(_qwen3_moe(experts=3))
    except ValueError as e:
        out["experts"] = str(e)
    reset_state()
    try:
        Accelerator(parallelism_config=ParallelismConfig(ep_size=2))
    except ValueError as e:
        out["no_fsdp"] = str(e)
    _accelerator(ep_size=2)  # the process state again, for the checks after this one
    return out

