"""The tensor-parallel plan, applied with DTensor (``torch.distributed.tensor.parallel.parallelize_module``).

The plan says how each linear layer's weight is split over the ``tp`` dimension of the mesh: the
user's (``ParallelismConfig(tp_plan=...)``, ``parallelize_module`` style), else the model's own
(transformers' ``config.base_model_tp_plan`` under the base model, plus the head's ``_tp_plan``).
Plan keys may use ``*`` for one name part (``layers.*.mlp.up_proj``); they are expanded to the
module names they match, and a key that matches nothing is an error. Sizes that ``tp`` does not
divide (attention heads, split dimensions) are named before any communication.

Applied by the ``tensor_plan`` layout step (``layout_steps``), under every engine that lays a model out
over ``tp``: alone, before FSDP2's sharding, on each pipeline stage.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Optional

from torch import nn

# transformers' style names -> how to build torch's ParallelStyle.
_STYLE_NAMES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "sequence_parallel")
# transformers' styles for mixture-of-experts weights, which ep_size splits instead (expert_parallel)
_EXPERT_STYLES = ("packed_colwise", "packed_rowwise", "moe_tp_experts", "moe_identity_expert")


def _style(name: Any, where: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

    if isinstance(name, ParallelStyle):
        return name
    key = str(name).lower()
    if key == "colwise":
        return ColwiseParallel()
    if key == "rowwise":
        return RowwiseParallel()
    if key in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if key == "rowwise_rep":
        return RowwiseParallel(input_layouts=Replicate())
    if key == "sequence_parallel":
        return SequenceParallel()
    if key in _EXPERT_STYLES:
        raise ValueError(f"tp_plan[{where!r}] = {name!r}: hasten does not split experts by tensor parallelism; split "
                         "them whole with expert parallelism (ParallelismConfig(ep_size=...), which borrows the tp "
                         "processes too), or leave the key out of tp_plan")
    if key == "replicated_with_grad_allreduce":
        return GradientSum()
    raise ValueError(f"tp_plan[{where!r}] = {name!r}: unknown style; use a torch ParallelStyle "
                     f"(ColwiseParallel(), RowwiseParallel(), ...) or one of {list(_STYLE_NAMES)}")


class GradientSum:
    """transformers' ``replicated_with_grad_allreduce``: the module's weights stay whole on every tp process,
    but what it computes on is split over tp (Qwen3's per-head ``q_norm``/``k_norm`` see this process's
    heads only), so each process's gradient of them is partial and is summed over tp in backward. torch
    has no ParallelStyle for it: ``install`` puts a forward pre-hook on the module that gives each weight
    it computes with a gradient hook (FSDP2's unsharded weights exist from the first forward on)."""

    def install(self, module: nn.Module, group: Any) -> None:
        module.register_forward_pre_hook(_SumGradients(group))


class _SumGradients:
    """Forward pre-hook of a ``GradientSum`` module: hook each weight it is about to compute with, once."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.hooked: dict[str, nn.Parameter] = {}  # by name: the weight object last hooked (FSDP2 may swap it)

    def __call__(self, module: nn.Module, args: Any) -> None:
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and self.hooked.get(name) is not param:
                param.register_hook(self._sum)
                self.hooked[name] = param

    def _sum(self, grad: Any) -> Any:
        """This backward's gradient summed over tp, before it is accumulated (so accumulation adds sums)."""
        import torch.distributed as dist

        local = grad.to_local() if hasattr(grad, "to_local") else grad
        total = local.clone()
        dist.all_reduce(total, group=self.group)
        if hasattr(grad, "to_local"):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(total, grad.device_mesh, grad.placements, run_check=False)
        return total


def base_model_plan(model: nn.Module, attribute: str) -> dict[str, Any]:
    """A transformers config's plan for the base model (``base_model_tp_plan``, ``base_model_ep_plan``), its keys
    named from ``model`` (under ``base_model_prefix`` when ``model`` is a head around the base model)."""
    base = getattr(getattr(model, "config", None), attribute, None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix + "." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    return {inner + key: style for key, style in base.items()}


def model_plan(model: nn.Module) -> dict[str, Any]:
    """The model's own plan (transformers): ``base_model_tp_plan`` under the base model, then ``_tp_plan``."""
    plan = base_model_plan(model, "base_model_tp_plan")
    own = getattr(type(model), "_tp_plan", None)
    if isinstance(own, dict):
        plan.update(own)
    return plan


def matches(pattern: str, name: str) -> bool:
    """Whether a plan key (``*`` for one name part) names the module ``name``."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def resolve_plan(model: nn.Module, user_plan: Optional[dict[str, Any]], own: bool = False) -> dict[str, Any]:
    """``{module name: ParallelStyle}`` for ``model``: the user's plan, else the model's own. ``own``:
    ``user_plan`` is the model's own plan (filtered): a key of it may match nothing (a transformers plan
    covers its config's variants, e.g. Qwen3-MoE's dense MLP layers), while a user's key must match."""
    own = own or user_plan is None
    plan = user_plan if user_plan is not None else model_plan(model)
    if not plan:
        raise ValueError(f"tp_size > 1 but {type(model).__name__} has no tensor-parallel plan; pass "
                         "ParallelismConfig(tp_plan={'layer.name': 'colwise', 'next.layer': 'rowwise'}) (torch "
                         "ParallelStyle objects work too), or apply parallelize_module yourself before prepare()")
    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        style = _style(style, pattern)  # first: a style hasten lacks is the clearer message
        names = [n for n in modules if n and matches(pattern, n)]
        if not names and not own:
            raise ValueError(f"tp_plan key {pattern!r} matches no module of {type(model).__name__}; module names "
                             f"look like {[n for n in modules if n][:6]}")
        for name in names:
            out[name] = style
    return out


def check_divisible(model: nn.Module, plan: dict[str, Any], tp: int, config: Any = None) -> None:
    """Name the heads / split sizes that ``tp`` does not divide (before any communication); ``config``:
    the model config holding the head counts (default ``model.config``; a pipeline stage passes its model's)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = config if config is not None else getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(f"tp_size={tp} does not divide {attr}={heads} of {type(model).__name__}; pick a tp_size "
                             f"that divides it (e.g. {max(d for d in range(1, heads + 1) if heads % d == 0 and d <= tp)})")
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules[name]
        if isinstance(module, nn.Linear):
            dim, size = ("out_features", module.out_features) if isinstance(style, ColwiseParallel) else \
                ("in_features", module.in_features) if isinstance(style, RowwiseParallel) else (None, 0)
            if dim and size % tp:
                raise ValueError(f"tp_size={tp} does not divide {name}.{dim}={size}; tensor parallelism splits it "
                                 "evenly, so pick a tp_size that divides it or leave the layer out of tp_plan")
        elif isinstance(module, nn.Embedding) and isinstance(style, RowwiseParallel) and module.num_embeddings % tp:
            raise ValueError(f"tp_size={tp} does not divide {name}.num_embeddings={module.num_embeddings}")
