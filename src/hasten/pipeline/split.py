"""Cutting a model into pipeline stages.

A stage is a list of *units*, the model's top-level pieces in execution order. Two kinds of model
can be cut, because for both hasten knows how data flows from one unit to the next:

* ``nn.Sequential``: each child is a unit; a stage runs its children in order.
* a transformers decoder LM with a ``base_model_pp_plan`` (Llama, Mistral, Qwen, ...): the units
  are the embedding, each decoder layer, the final norm and the LM head. The embedding always goes
  with the first stage, the norm and the head (and the loss) with the last.

Where the cuts go: ``pp_split_points`` (names of units that begin a new stage), else evenly by
layer count; when the layers do not divide evenly, the earlier stages get one extra layer each
(the last stage also runs the head and the loss, so it should not get more layers).

Each stage is a deep copy of the model that *shares* its parameters and buffers with the original
(so an optimizer built on the original keeps pointing at the right tensors), with every unit of
other stages removed. The names stay the original ones (``model.layers.2.mlp.up_proj.weight``):
Sequential children are dropped from ``_modules`` without renumbering, and a decoder's layer list
becomes a ``ModuleDict`` keyed by the original indices, so a stage's state dict maps back to the
full model's checkpoint.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Optional

import torch
from torch import nn

_OPTION = "ParallelismConfig(pp_split_points=[...])"


def model_kind(model: nn.Module) -> str:
    """"sequential" or "decoder" (see the module docstring); ValueError for a model hasten cannot cut."""
    if isinstance(model, nn.Sequential):
        return "sequential"
    if _decoder_parts(model) is not None:
        return "decoder"
    raise ValueError(
        f"pipeline parallelism cannot split a {type(model).__name__}: hasten cuts an nn.Sequential (between its "
        "children) or a transformers decoder LM with a base_model_pp_plan (between its decoder layers). Put the "
        "model's blocks in an nn.Sequential (and name the first block of each stage with pp_split_points, e.g. "
        f"{_OPTION}), or use pp_size=1")


def _decoder_parts(model: nn.Module) -> Optional[dict[str, Any]]:
    """The names of a decoder LM's pieces from its ``base_model_pp_plan``, or None when it is not one."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not plan or not isinstance(base, nn.Module) or head is None:
        return None
    names = list(plan)
    lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(lists) != 1 or not hasattr(base, "rotary_emb"):
        return None
    layers = lists[0]
    head_name = next(n for n, m in model.named_children() if m is head)
    at = names.index(layers)
    return {"prefix": prefix, "before": names[:at], "layers": layers, "after": names[at + 1:], "head": head_name,
            "count": len(getattr(base, layers))}


def _layer_units(model: nn.Module) -> list[str]:
    """The units the cut is counted in (Sequential children; a decoder's layers)."""
    if model_kind(model) == "sequential":
        return [name for name, _ in model.named_children()]
    parts = _decoder_parts(model)
    return [f"{parts['prefix']}.{parts['layers']}.{i}" for i in range(parts["count"])]


def plan_stages(model: nn.Module, num_stages: int, split_points: Optional[list[str]] = None) -> list[list[str]]:
    """The units of each of ``num_stages`` stages, in order (see the module docstring for the rule)."""
    units = _layer_units(model)
    if split_points:
        cuts = _cuts_from_points(units, num_stages, list(split_points))
    else:
        if len(units) < num_stages:
            raise ValueError(
                f"pipeline parallelism: {type(model).__name__} has {len(units)} layers ({', '.join(units) or 'none'}) "
                f"for {num_stages} stages (pp_size x pp_stages_per_rank); every stage needs at least one layer: use "
                f"fewer stages (pp_size, pp_stages_per_rank, or a one-stage-per-process schedule such as '1F1B'), "
                f"or a model with more layers. pp_split_points cannot make more stages than layers")
        base, extra = divmod(len(units), num_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]  # earlier stages get the extra layer
        cuts = list(itertools.accumulate([0] + sizes))
    stages = [units[cuts[i]:cuts[i + 1]] for i in range(num_stages)]
    if model_kind(model) == "decoder":
        parts = _decoder_parts(model)
        stages[0] = [f"{parts['prefix']}.{n}" for n in parts["before"]] + stages[0]
        stages[-1] = stages[-1] + [f"{parts['prefix']}.{n}" for n in parts["after"]] + [parts["head"]]
    return stages


def _cuts_from_points(units: list[str], num_stages: int, points: list[str]) -> list[int]:
    if len(points) != num_stages - 1:
        raise ValueError(f"pp_split_points={points} names {len(points)} cut(s); {num_stages} stages need "
                         f"{num_stages - 1} (each name begins a new stage)")
    cuts = [0]
    for point in points:
        if point not in units:
            raise ValueError(f"pp_split_points: {point!r} is not one of the names of the model's layers "
                             f"({', '.join(units[:6])}{', ...' if len(units) > 6 else ''}); name the layer that "
                             "begins each new stage")
        at = units.index(point)
        if at == 0:
            raise ValueError(f"pp_split_points: {point!r} is the first layer, so the first stage would be empty; "
                             f"name the layer that begins the second stage, e.g. {units[1]!r}" if len(units) > 1 else "")
        if at <= cuts[-1]:
            raise ValueError(f"pp_split_points={points}: the names must be in increasing layer order, each "
                             "beginning a new, non-empty stage")
        cuts.append(at)
    return cuts + [len(units)]


# -- building one stage -------------------------------------------------------------------------
def build_stage(model: nn.Module, units: list[str]) -> nn.Module:
    """A copy of ``model`` holding only ``units`` (sharing their parameters with ``model``), whose
    forward runs this stage: what the pipeline stage calls with the previous stage's output."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    stage = copy.deepcopy(model, memo=shared)
    keep = set(units)
    if model_kind(model) == "sequential":
        for name in [n for n in stage._modules if n not in keep]:
            del stage._modules[name]  # not ``del stage[i]``: that renumbers the children
        return stage
    parts = _decoder_parts(model)
    prefix, base = parts["prefix"], getattr(stage, parts["prefix"])
    layers = getattr(base, parts["layers"])
    kept = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)
                          if f"{prefix}.{parts['layers']}.{i}" in keep})
    setattr(base, parts["layers"], kept)
    for name in parts["before"] + parts["after"]:
        if f"{prefix}.{name}" not in keep:
            setattr(base, name, None)
    if parts["head"] not in keep:
        setattr(stage, parts["head"], None)
    return DecoderStage(stage, parts)


class DecoderStage(nn.Module):
    """One stage of a decoder LM: token ids (first stage) or hidden states in; hidden states, or
    logits on the last stage, out. It holds the cut copy's children under their own names, so every
    parameter keeps its name in the full model; rotary embeddings and the causal mask are recomputed on
    each stage (they hold no parameters) as the model's own forward computes them for an unpadded batch."""

    def __init__(self, stage: nn.Module, parts: dict[str, Any]) -> None:
        super().__init__()
        if stage._parameters or stage._buffers:
            raise ValueError(f"pipeline parallelism: {type(stage).__name__} holds parameters or buffers of its own "
                             "outside its submodules, which no stage would own; cut it with pp_split_points on an "
                             "nn.Sequential of its parts instead")
        for name, child in stage._modules.items():
            self.add_module(name, child)  # None for the parts another stage holds
        self.parts = parts
        self.config = getattr(stage, "config", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _decoder_stage_forward(self, self.parts, hidden)


def _decoder_stage_forward(self: nn.Module, parts: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor:
    base = getattr(self, parts["prefix"])
    for name in parts["before"]:
        module = getattr(base, name)
        if module is not None:
            hidden = module(hidden)
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = _causal_mask(base.config, hidden, positions)
    rotary = base.rotary_emb(hidden, position_ids=positions)
    for layer in getattr(base, parts["layers"]).values():
        hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        if isinstance(hidden, tuple):  # older transformers return (hidden_states, ...)
            hidden = hidden[0]
    for name in parts["after"]:
        module = getattr(base, name)
        if module is not None:
            hidden = module(hidden)
    head = getattr(self, parts["head"])
    return head(hidden) if head is not None else hidden


def _causal_mask(config: Any, hidden: torch.Tensor, positions: torch.Tensor) -> Any:
    from transformers.masking_utils import create_causal_mask

    try:
        return create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
    except TypeError:  # transformers 4 names the cache past_key_values
        return create_causal_mask(config=config, input_embeds=hidden, attention_mask=None, cache_position=positions[0],
                                  past_key_values=None, position_ids=positions)

