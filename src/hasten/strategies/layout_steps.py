"""The layout steps: how a module is laid out over the mesh's axes, in one order for every engine.

A prepared model is an engine (``DDPStrategy``: a replica per process; ``FSDP2Strategy``: shards;
``TensorParallelStrategy``: none of its own; ``PipelineStrategy``: the schedule over stages) plus
the steps of ``STEPS`` that its layout needs, applied by ``lay_out`` in this order to each module the
engine trains (the whole model, or each pipeline stage after the split):

1. ``context_parallel`` (``cp``): attention made to run on a sequence shard (causal SDPA, no mask; on
   the CPU routed to torch's ring with the CPU kernel, ``ring_attention.py``);
   ``sequence_parallel`` (``sp``): attention routed through Ulysses' all-to-all over heads
   (``sequence_parallel.py``); cp and sp exclude each other;
2. ``tensor_plan`` (``tp``): the planned layers split with ``parallelize_module``;
3. ``expert_parallel`` (``ep``, borrowed from ``dp_shard x cp x sp x tp``): the experts modules' experts split over the
   ``ep`` processes, tokens sent to them by all-to-all (``expert_parallel``); by module name, so before
   checkpointing renames the blocks, and before sharding (FSDP2 shards the experts on their own mesh);
4. ``activation_checkpointing``: the blocks wrapped; after the plans (they match module names the
   wrapper changes), before sharding (FSDP2 then shards the blocks inside the wrappers);
5. ``sharding`` (``dp_shard``/``dp_replicate`` under FSDP2): ``fully_shard`` per block, then the root.

What comes before the steps: the pipeline split (``pp``, ``hasten.pipeline.split``: one model becomes
this process's stages, each laid out on its own), float8 conversion and regional compilation (the
facade, in place). What comes after: the engine's wrapper (DDP), whole-model ``torch.compile``.

A step says when it is needed (``needed``) from the ``Target`` alone, so adding an axis is one step
here, its module, and its field in ``hasten.layout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from .expert_parallel import planned_experts, without_experts
from .mesh import ParallelMesh
from .tp_plan import GradientSum, check_divisible, matches, model_plan, resolve_plan


@dataclass(frozen=True)
class Target:
    """One module to lay out and what the steps read about it.

    ``whole``: the model the module was cut from (itself unless it is a pipeline stage); the
    tensor-parallel plan is the whole model's, restricted to the stage's layers. ``checkpoint`` and
    ``shard`` are the engine's activation checkpointing and sharding (None: the engine has none).
    """

    module: nn.Module
    mesh: ParallelMesh
    config: Any  # the ParallelismConfig, or None
    whole: nn.Module
    checkpoint: Optional[Callable[[nn.Module], None]] = None
    shard: Optional[Callable[[nn.Module], None]] = None

    def size(self, axis: str) -> int:
        """The axis's size: a mesh dimension's, or a borrowed axis's (``ep``: ``mesh.ep``)."""
        return self.mesh.sizes.get(axis, getattr(self.mesh, axis, 1))

    @property
    def is_stage(self) -> bool:
        return self.module is not self.whole


@dataclass(frozen=True)
class Step:
    name: str
    axis: Optional[str]  # the mesh axis it serves (None: not an axis)
    needed: Callable[[Target], bool]
    apply: Callable[[Target], None]


def _context_parallel(target: Target) -> None:
    from .context_parallel import prepare_model

    prepare_model(target.module, getattr(target.config, "cp_handler", None), target.mesh.device_type)


def _sequence_parallel(target: Target) -> None:
    from .sequence_parallel import prepare_model

    prepare_model(target.module, target.size("sp"))


def tensor_plan(target: Target) -> dict[str, Any]:
    """``{module name: ParallelStyle}`` for ``target.module``: the user's plan, else the whole model's
    own; for a stage, the plan's keys that name its layers (a stage may have none). With ``ep`` the keys
    naming the experts go: the experts are split over ep instead (``expert_parallel.without_experts``)."""
    user = getattr(target.config, "tp_plan", None)
    plan = user if user is not None else model_plan(target.whole)  # a stage is no model class
    if target.size("ep") > 1:
        plan = without_experts(plan, target.module, planned_experts(target.module, target.whole, target.config))
    if not target.is_stage:
        return resolve_plan(target.module, plan, own=user is None)
    names = [n for n, _ in target.module.named_modules() if n]
    here = {k: v for k, v in plan.items() if any(matches(k, n) for n in names)}
    return resolve_plan(target.module, here) if here else {}


def _tensor_plan(target: Target) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tensor_plan(target)
    summed = {name: style for name, style in plan.items() if isinstance(style, GradientSum)}
    styles = {name: style for name, style in plan.items() if name not in summed}
    if styles:
        check_divisible(target.module, styles, target.size("tp"), config=getattr(target.whole, "config", None))
        parallelize_module(target.module, target.mesh["tp"], styles)
    for name, style in summed.items():
        style.install(target.module.get_submodule(name), target.mesh["tp"].get_group())


def _expert_parallel(target: Target) -> None:
    from .expert_parallel import apply_expert_parallel

    apply_expert_parallel(target.module, target.whole, target.mesh, target.config)


STEPS: tuple[Step, ...] = (
    Step("context_parallel", "cp", lambda t: t.size("cp") > 1, _context_parallel),
    Step("sequence_parallel", "sp", lambda t: t.size("sp") > 1, _sequence_parallel),
    Step("tensor_plan", "tp", lambda t: t.size("tp") > 1, _tensor_plan),
    Step("expert_parallel", "ep", lambda t: t.size("ep") > 1, _expert_parallel),
    Step("activation_checkpointing", None, lambda t: t.checkpoint is not None, lambda t: t.checkpoint(t.module)),
    Step("sharding", "dp_shard", lambda t: t.shard is not None, lambda t: t.shard(t.module)),
)


def steps_for(target: Target) -> list[Step]:
    """The steps ``target`` needs, in ``STEPS`` order."""
    return [step for step in STEPS if step.needed(target)]


def lay_out(target: Target) -> list[str]:
    """Apply the needed steps to ``target.module`` in place, in order; returns their names."""
    done = []
    for step in steps_for(target):
        step.apply(target)
        done.append(step.name)
    return done
