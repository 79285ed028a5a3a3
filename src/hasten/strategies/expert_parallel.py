"""Expert parallelism: the routed experts of a mixture-of-experts model split over the ``ep`` processes.

``ParallelismConfig(ep_size=N)`` (with FSDP2) gives each of ``N`` consecutive processes of one model
copy's ``dp_shard x cp x sp x tp`` block ``num_experts / N`` whole experts. The processes keep their own
tokens (ep *borrows* them, ``hasten.layout``); in every experts module, each (token, expert) pair
travels to the process that holds the expert and the result comes back (two all-to-alls per layer,
forward and backward); tp processes, which hold the same tokens, each send a disjoint slice of them
(``ParallelMesh.same_tokens_mesh``), and the tensor plan leaves the experts out (``without_experts``:
they are split whole, torchtitan's expert-tp of 1). Applied
by the ``expert_parallel`` layout step (``layout_steps``), after the tensor plan and before activation
checkpointing and sharding; FSDP2 then shards the experts over the processes that hold the same
experts (``efsdp``, ``ParallelMesh.expert_mesh``) and everything else as usual.

**The plan** says which modules are experts modules, as the tensor-parallel plan says which layers
split: the user's (``ParallelismConfig(ep_plan={"layers.*.moe.experts": "experts"})``), else the
model's own (transformers' ``config.base_model_ep_plan``: its ``ep_dispatch_experts`` keys name the
experts modules, its ``grouped_gemm`` keys their weights). ``*`` matches one name part; a key that
matches nothing is an error. An experts module (transformers' or a plain PyTorch one) must:

- hold its experts' weights as parameters whose first dimension is the expert (``[num_experts, ...]``,
  e.g. fused ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``), and say ``num_experts``;
- compute ``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``: the
  routing-weighted sum of the chosen experts' outputs, expert ids in ``[0, num_experts)``.

Its parameters become ``DTensor``s sharded on dimension 0 over ``ep`` (checkpoints and
``save_model`` see the whole experts); its forward is run on this process's experts only, by
transformers' own token dispatcher (``transformers.distributed.expert_parallel.AllToAllEP``, the
all-to-all it uses for training); ``num_experts`` becomes the local count, as transformers does.
transformers' ``apply_expert_parallelism`` itself is not called: it replaces ``module.forward`` on the
instance, and hasten replaces no method of a torch or transformers object. Instead the experts
module's class becomes a subclass of its own (``ExpertParallelExperts`` first in the order), the
mechanism FSDP2's ``fully_shard`` uses, so names, parameters and hooks stay those of the module.

**Loading and pipeline stages.** The experts are split without communication (each process keeps its
own rows of the weights it built, as FSDP2 keeps its chunk), so a model built on ``meta`` is laid out as
it is and filled afterwards by ``load_checkpoint_in_model`` (each process copying its experts' rows,
``shard_loading.held_block``) or by the fill from process 0. Under pipeline parallelism the step runs
on each stage (``stage_plan``: the whole model's plan restricted to the stage); the experts' mesh has a
``pp`` dimension, so each stage's ``dp_shard`` processes split that stage's experts.

**The router's auxiliary loss.** transformers computes the load-balancing loss of each process's own
tokens; the one-process model computes it over the whole batch, and the two differ (it multiplies
two means). On a transformers MoE model (``router_aux_loss_coef``) a forward hook replaces
``aux_loss`` (and the part of ``loss`` it made) with the loss of the whole batch: the token counts and
router probabilities are summed over the processes holding different tokens (data-parallel, cp, sp:
``ParallelMesh.token_parallel``; one all-reduce), and the gradient of each process's part is scaled so
that the average over them is the one-process gradient.
Under a pipeline the whole model's forward never runs (hasten's pipeline computes the loss on the last
stage), so ``refuse_router_aux_loss`` refuses a model that adds this loss.
"""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import torch
from torch import nn

from .tp_plan import base_model_plan, matches

EXPERTS = "experts"  # hasten's style name: a whole experts module (its first-dimension parameters split)
_TRANSFORMERS_MODULE = "ep_dispatch_experts"  # transformers' style names in base_model_ep_plan
_TRANSFORMERS_PARAM = "grouped_gemm"


# -- the plan ---------------------------------------------------------------------------------------
def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan (transformers' ``config.base_model_ep_plan``, under the base model)."""
    return base_model_plan(model, "base_model_ep_plan")


def resolve_plan(model: nn.Module, user_plan: Optional[dict[str, Any]]) -> dict[str, list[str]]:
    """``{experts module name: [names of the parameters split on dimension 0]}`` for ``model``."""
    plan = user_plan if user_plan is not None else model_plan(model)
    if not plan:
        raise ValueError(f"ep_size > 1 but {type(model).__name__} has no expert-parallel plan; pass "
                         "ParallelismConfig(ep_plan={'layers.*.moe.experts': 'experts'}) naming its experts modules "
                         "(see hasten.strategies.expert_parallel for what such a module computes)")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    out: dict[str, list[str]] = {}
    named_params: dict[str, list[str]] = {}
    for pattern, style in plan.items():
        style = str(style)
        if style in (EXPERTS, _TRANSFORMERS_MODULE):
            found = [n for n in modules if n and matches(pattern, n)]
            for name in found:
                out.setdefault(name, [])
        elif style == _TRANSFORMERS_PARAM:
            found = [n for n in params if matches(pattern, n)]
            for name in found:
                owner, _, param = name.rpartition(".")
                named_params.setdefault(owner, []).append(param)
        else:
            raise ValueError(f"ep_plan[{pattern!r}] = {style!r}: unknown style; use {EXPERTS!r} for an experts module "
                             f"(transformers' plans: {_TRANSFORMERS_MODULE!r} and {_TRANSFORMERS_PARAM!r})")
        if not found:
            raise ValueError(f"ep_plan key {pattern!r} matches no {'parameter' if style == _TRANSFORMERS_PARAM else 'module'}"
                             f" of {type(model).__name__}; module names look like {[n for n in modules if n][:6]}")
    for owner, names in named_params.items():
        if owner not in out:
            raise ValueError(f"ep_plan splits {owner}.{names[0]} but names no experts module {owner!r} "
                             f"({_TRANSFORMERS_MODULE!r}); its tokens would not reach the split experts")
    for name in out:
        module = modules[name]
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"ep_plan names {name} ({type(module).__name__}), which says no num_experts; an experts "
                             "module holds num_experts and parameters of shape [num_experts, ...]")
        split = named_params.get(name) or [n for n, p in module.named_parameters(recurse=False)
                                           if p.dim() >= 1 and p.shape[0] == count]
        if not split:
            raise ValueError(f"{name} ({type(module).__name__}) has no parameter of shape [num_experts={count}, ...] "
                             "to split over ep")
        out[name] = split
    return out


def check_experts(model: nn.Module, plan: dict[str, list[str]], ep: int) -> None:
    """Name an experts module whose number of experts ``ep`` does not divide (before any communication)."""
    modules = dict(model.named_modules())
    for name in plan:
        count = modules[name].num_experts
        if count % ep:
            fits = max(d for d in range(1, count + 1) if count % d == 0 and d <= ep)
            raise ValueError(f"ep_size={ep} does not divide num_experts={count} of {name}: every ep process holds "
                             f"the same number of whole experts; use ep_size={fits} (or one that divides {count})")


# -- the experts module ---------------------------------------------------------------------------
class ExpertParallelExperts:
    """The first base of an experts module's expert-parallel class (``expert_parallel_class``).

    ``forward`` sends each (token, expert) pair to the process holding the expert and brings the
    weighted results back (``dispatcher``: transformers' ``AllToAllEP``); the module's own forward
    runs there on this process's experts (``local_forward``), with the local parts of its DTensor
    parameters.
    """

    dispatcher: Any  # set by shard_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.dispatcher(hidden_states, top_k_index, top_k_weights).to(hidden_states.dtype)

    def local_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts' own forward on local expert ids ``[0, num_experts / ep)``."""
        with _local_parameters(self):
            return super().forward(hidden_states, top_k_index, top_k_weights)  # type: ignore[misc]


_CLASSES: dict[type, type] = {}  # experts class -> its expert-parallel subclass (one per class)


def expert_parallel_class(cls: type) -> type:
    """``ExpertParallel<cls>``: ``ExpertParallelExperts`` then ``cls`` (made once per class)."""
    if issubclass(cls, ExpertParallelExperts):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
    return _CLASSES[cls]


@contextlib.contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their local parts (differentiable ``to_local``) for one
    forward: its own forward mixes them with plain tensors. The DTensors are put back after."""
    from torch.distributed.tensor import DTensor

    held = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    for name, param in held.items():
        module._parameters[name] = param.to_local()
    try:
        yield
    finally:
        for name, param in held.items():
            module._parameters[name] = param


def is_expert_parallel(module: nn.Module) -> bool:
    return isinstance(module, ExpertParallelExperts)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules of ``model`` split over ``ep``, in ``modules()`` order (FSDP2 shards them before
    the blocks holding them)."""
    return [m for m in model.modules() if is_expert_parallel(m)]


def shard_experts(module: nn.Module, names: list[str], ep_mesh: Any, batch_mesh: Any) -> None:
    """Split ``module``'s experts over ``ep_mesh`` (``names``: its parameters of shape [num_experts, ...]).

    ``batch_mesh``: the processes that hold the same tokens (``ParallelMesh.same_tokens_mesh``: the tp
    processes; size 1 without tensor parallelism)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.distributed.expert_parallel import AllToAllEP

    ep = ep_mesh.size()
    for name in names:
        param = module._parameters[name]
        # Each process keeps its own experts of the weights it built (no communication), as FSDP2 keeps its
        # own chunk: the same weights on every process, or meta ones that load_checkpoint_in_model (or
        # cpu_ram_efficient_loading's fill from process 0) gives values after prepare().
        split = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        setattr(module, name, nn.Parameter(split, requires_grad=param.requires_grad))
    module.num_experts = module.num_experts // ep
    if hasattr(module, "_is_expert_parallel"):  # transformers' flag: "my experts are split"
        module._is_expert_parallel = True
    module.__class__ = expert_parallel_class(type(module))
    local = SimpleNamespace(forward=module.local_forward, num_experts=module.num_experts)
    module.dispatcher = AllToAllEP(local, ep_mesh, batch_mesh)


# -- the router's auxiliary loss ----------------------------------------------------------------
def _load_balancing_statistics(router_logits: tuple, num_experts: int, top_k: int,
                               attention_mask: Optional[torch.Tensor]) -> tuple:
    """(tokens per expert, router probability sums, rows) of this process's tokens, summed over the
    layers, as transformers' ``load_balancing_loss_func`` accumulates them."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for gate in router_logits:
        weights = torch.nn.functional.softmax(gate.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        each = torch.ones(chosen.numel(), device=device) if mask is None else mask.repeat_interleave(top_k)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), each)
        probs = probs + (weights.float() if mask is None else weights.float() * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + (weights.shape[0] if mask is None else mask.sum())
    return counts, probs, rows


def global_load_balancing_loss(router_logits: tuple, num_experts: int, top_k: int,
                               attention_mask: Optional[torch.Tensor], group: Any, size: int) -> torch.Tensor:
    """The load-balancing loss of the whole batch of the ``size`` data-parallel processes of ``group``.

    Its value is the one-process model's; its gradient through this process's router probabilities
    is ``size`` times their share, so that averaging the gradients over the processes (what
    data-parallel training does) gives the one-process gradient."""
    import torch.distributed as dist

    counts, probs, rows = _load_balancing_statistics(router_logits, num_experts, top_k, attention_mask)
    totals = torch.cat([counts, probs.detach(), rows.reshape(1)])
    dist.all_reduce(totals, group=group)
    all_counts, all_probs, all_rows = totals[:num_experts], totals[num_experts:-1], totals[-1]
    probs = all_probs + size * (probs - probs.detach())  # the whole batch's value, this process's gradient x size
    return torch.sum((all_counts / all_rows) * (probs / all_rows)) * num_experts


class _SequenceMeanGradient(torch.autograd.Function):
    """Identity forward; backward: the gradient's mean over the processes of a cp/sp group.

    The whole-batch auxiliary loss is one number per batch, not a mean over tokens; but under cp/sp the
    loss holding it goes through ``loss_over_sequence``, whose backward gives each process of the group
    its labelled tokens' share (``cp x n_r / N``, which average to 1). Taking the group's mean of the
    gradient that reaches the auxiliary loss undoes that weighting whatever the counts (and changes
    nothing when the loss is not weighted), keeping the scaling every process shares (accumulation,
    loss scaling)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad / dist.get_world_size(ctx.group), None


class _WholeBatchAuxLoss:
    """Forward hook (with kwargs) of a transformers MoE model: ``aux_loss`` and ``loss`` of the whole batch.
    ``sequence_group``: the cp or sp processes splitting each sequence (None without)."""

    def __init__(self, model: nn.Module, group: Any, size: int, sequence_group: Any = None) -> None:
        self.group, self.size, self.sequence_group = group, size, sequence_group
        self.num_experts, self.top_k = model.num_experts, model.num_experts_per_tok
        self.coef = model.router_aux_loss_coef
        self.signature = inspect.signature(type(model).forward)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        local = output.get("aux_loss") if hasattr(output, "get") else None
        logits = output.get("router_logits") if local is not None else None
        if local is None or not logits:
            return None
        bound = self.signature.bind_partial(module, *args, **kwargs).arguments
        whole = global_load_balancing_loss(tuple(logits), self.num_experts, self.top_k, bound.get("attention_mask"),
                                           self.group, self.size)
        if self.sequence_group is not None and torch.is_grad_enabled() and whole.requires_grad:
            whole = _SequenceMeanGradient.apply(whole, self.sequence_group)
        output["aux_loss"] = whole
        if output.get("loss") is not None and bound.get("labels") is not None:  # transformers added coef x its own
            output["loss"] = output["loss"] - self.coef * local.to(output["loss"].device) + \
                self.coef * whole.to(output["loss"].device)
        return output


def _routes_aux_loss(model: nn.Module) -> bool:
    return all(hasattr(model, a) for a in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok"))


# -- the layout step ------------------------------------------------------------------------------
def stage_plan(module: nn.Module, whole: nn.Module, user_plan: Optional[dict[str, Any]]) -> dict[str, list[str]]:
    """The plan of a pipeline stage cut from ``whole``: the whole model's plan (the user's, else its own),
    restricted to the keys that name the stage's modules or parameters (a stage may hold no experts)."""
    plan = user_plan if user_plan is not None else model_plan(whole)
    if not plan:
        return resolve_plan(whole, plan)  # the error naming ep_plan
    everywhere = [n for n, _ in whole.named_modules() if n] + [n for n, _ in whole.named_parameters()]
    lost = [k for k in plan if not any(matches(k, n) for n in everywhere)]
    if lost:
        raise ValueError(f"ep_plan key {lost[0]!r} matches no module or parameter of {type(whole).__name__}")
    here = [n for n, _ in module.named_modules() if n] + [n for n, _ in module.named_parameters()]
    mine = {k: v for k, v in plan.items() if any(matches(k, n) for n in here)}
    return resolve_plan(module, mine) if mine else {}


def planned_experts(module: nn.Module, whole: nn.Module, config: Any) -> dict[str, list[str]]:
    """The expert-parallel plan of ``module`` (the model, or a pipeline stage cut from ``whole``)."""
    user = getattr(config, "ep_plan", None)
    return resolve_plan(module, user) if module is whole else stage_plan(module, whole, user)


def without_experts(tp_plan: dict[str, Any], module: nn.Module, experts: dict[str, list[str]]) -> dict[str, Any]:
    """``tp_plan`` less its keys naming the ``experts`` modules of ``module`` or anything inside them: with
    ``ep`` the experts are split whole over the ep processes (borrowing the tp ones), not by tensor
    parallelism (torchtitan's ``etp = 1``)."""
    inside = [n for e in experts for n, _ in module.named_modules() if n == e or n.startswith(e + ".")]
    inside += [n for e in experts for n, _ in module.named_parameters() if n.startswith(e + ".")]
    return {k: v for k, v in tp_plan.items() if not any(matches(k, n) for n in inside)}


def apply_expert_parallel(module: nn.Module, whole: nn.Module, mesh: Any, config: Any) -> list[str]:
    """Split the experts of ``module`` (the model, or a pipeline stage cut from ``whole``) over the mesh's
    ``ep`` processes (the ``expert_parallel`` layout step); returns the experts modules' names."""
    plan = planned_experts(module, whole, config)
    check_experts(module, plan, mesh.ep)
    experts = mesh.expert_mesh()
    modules = dict(module.named_modules())
    for name, params in plan.items():
        shard_experts(modules[name], params, experts["ep"], mesh.same_tokens_mesh())
    data = mesh.token_parallel()
    if module is whole and _routes_aux_loss(whole) and data.size > 1:
        # Under a pipeline the stages never run the whole model's forward: hasten's pipeline computes the loss,
        # and PipelineStrategy refuses a model that adds the router's loss (refuse_router_aux_loss).
        split = next((a for a in ("cp", "sp") if mesh.sizes[a] > 1), None)
        sequence_group = mesh[split].get_group() if split else None
        whole.register_forward_hook(_WholeBatchAuxLoss(whole, data.group, data.size, sequence_group), with_kwargs=True)
    return list(plan)


def refuse_router_aux_loss(model: nn.Module) -> None:
    """Under pipeline parallelism: refuse a mixture-of-experts model whose loss adds the router's
    load-balancing loss (``output_router_logits`` with ``router_aux_loss_coef`` != 0). hasten's pipeline
    computes the loss on the last stage from its output alone (``hasten.pipeline.model``); the router
    logits of the other stages' layers never reach it, and the load-balancing loss multiplies statistics
    of every layer and of the whole batch, which no microbatch's backward (1F1B) can wait for."""
    config = getattr(model, "config", None)
    coef = getattr(config, "router_aux_loss_coef", 0) or 0
    if getattr(config, "output_router_logits", False) and coef:
        raise ValueError(f"pipeline parallelism: {type(model).__name__} adds router_aux_loss_coef={coef} x the "
                         "router's load-balancing loss to its loss (config.output_router_logits=True), which hasten's "
                         "pipeline does not compute (its loss is the last stage's); set "
                         "model.config.output_router_logits = False before prepare, or use pp_size=1")


def expert_shard_mesh(mesh: Any) -> Any:
    """The processes FSDP2 shards the experts over: those holding the same experts (``efsdp``), with
    ``dp_replicate`` (HSDP) when it is larger than 1."""
    experts = mesh.expert_mesh()
    return experts[("dp_replicate", "efsdp")] if mesh.sizes["dp_replicate"] > 1 else experts["efsdp"]


def fully_shard_experts(model: nn.Module, layout: Any, **kwargs: Any) -> list[nn.Module]:
    """``fully_shard`` each experts module of ``model`` split over ep (``expert_modules``) over the processes
    holding the same experts (``expert_shard_mesh`` of ``layout``, the ``ParallelMesh``), before the blocks holding them are sharded; ``kwargs``:
    the engine's other ``fully_shard`` arguments. Returns the experts modules."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    experts = expert_modules(model)
    for module in experts:
        # Each expert's gradient already sums the tokens of the ep processes (each token sent once, also
        # from tp processes holding the same tokens), so it is divided by every process holding other
        # tokens, as the dense gradients are averaged over them.
        shard_mesh = expert_shard_mesh(layout)
        fully_shard(module, **dict(kwargs, mesh=shard_mesh))
        module.set_gradient_divide_factor(float(layout.token_size))
        # A custom factor is NCCL's PREMUL_SUM in the reduce-scatter; elsewhere (gloo) sum, then divide.
        # Not on a one-process shard group: torch 2.13 then divides by the factor twice.
        if dist.get_backend() != "nccl" and shard_mesh.size(shard_mesh.ndim - 1) > 1:
            module.set_force_sum_reduction_for_comms(True)
    return experts
