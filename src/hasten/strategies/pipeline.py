"""Pipeline parallelism: ``ParallelismConfig(pp_size=N)``, each process runs some stages of the model.

The mesh puts ``pp`` outermost; every stage of one data-parallel replica reads the same batches
(``ParallelMesh.data_parallel`` leaves ``pp`` out). ``wrap_model`` cuts the model
(``hasten.pipeline.split``) and returns a ``PipelinedModel`` whose forward runs torch's schedule,
backward included; what the other strategies do in backward and around the optimizer is done here
over the stages:

* optimizers built on the full model keep only this process's parameters (the stages share the
  original parameter tensors, so nothing else is re-pointed);
* ``clip_grad_norm_`` adds up the squared norms of every stage (all-reduce over ``pp``), so every
  process clips with, and returns, the same total norm as one process would;
* with ``dp_replicate_size`` > 1, gradients are averaged over the replicas after the schedule step
  of each sync step (DDP's result; accumulation micro-steps skip it, as DDP's ``no_sync``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..pipeline.model import PipelinedModel, given_loss
from ..pipeline.schedule import local_stage_indices, stage_owner
from ..pipeline.split import build_stage, model_kind, plan_stages
from ..utils.dataclasses import DistributedType
from .base import Params, Strategy
from .mesh import ParallelMesh


class PipelineStrategy(Strategy):
    """``ParallelismConfig(pp_size=N[, dp_replicate_size=R])``: pipeline stages over N processes per replica."""

    # Each process writes its own stages' parameters and optimizer state as DCP shards, under the
    # original names (``hasten.checkpointing.sharded`` asks the PipelinedModel for them): any layout reads them.
    checkpoint_format = "dcp"
    # prepare must not move the whole model to the GPU first: only this process's stages go there.
    places_model_itself = True

    def __init__(self, plan: Any) -> None:
        self.parallelism_config = plan.parallelism_config
        self.gradient_state = plan.gradient_state
        self._local_ids: set[int] = set()  # id() of the parameters this process's stages hold
        self._model_ids: set[int] = set()  # id() of every parameter of the prepared models
        self._models: list[PipelinedModel] = []
        self._names: dict[int, str] = {}  # id() of every parameter of the prepared models -> its original name
        self._params_by_name: dict[str, nn.Parameter] = {}
        super().__init__(plan)
        self.distributed_type = plan.distributed_type
        cfg = self.parallelism_config
        for name in ("tp_size", "cp_size", "dp_shard_size"):
            if getattr(cfg, name) > 1:
                raise ValueError(f"ParallelismConfig: pp_size={cfg.pp_size} with {name}={getattr(cfg, name)} is not "
                                 f"supported yet; pipeline parallelism composes with dp_replicate_size only (set {name}=1)")
        if plan.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise ValueError(f"ParallelismConfig: pp_size={cfg.pp_size} with {plan.distributed_type} is not supported "
                             "yet; drop the FSDP/DeepSpeed plugin (use dp_replicate_size for data parallelism)")
        if plan.mixed_precision != "no":
            raise ValueError(f"pipeline parallelism with mixed_precision={plan.mixed_precision!r} is not supported yet; "
                             "use mixed_precision='no' (or load the model in bfloat16)")
        if self.activation_checkpointing is not None:
            raise ValueError("pipeline parallelism with activation checkpointing is not supported yet; drop "
                             "ActivationCheckpointingKwargs")

    def build_mesh(self) -> ParallelMesh:
        return ParallelMesh(self.parallelism_config.sizes(), self.state.process_index, self.state.num_processes,
                            self.state.device.type)

    # -- the model ------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        cfg = self.parallelism_config
        kind = model_kind(model)
        stages = plan_stages(model, cfg.pp_stages, cfg.pp_split_points)  # refused here, before any collective
        _refuse_shared_across_stages(model, stages)
        loss_fn = given_loss(model)
        if loss_fn is None and kind != "decoder":
            raise ValueError(f"pipeline parallelism: the last stage of this {type(model).__name__} computes the loss, "
                             "so it needs the loss function: call hasten.pipeline.pipeline_loss(model, loss_fn) "
                             "before accelerator.prepare(model) (loss_fn(output, target) -> mean over the samples)")
        pp_rank, pp_size = self.mesh.coordinates()["pp"], cfg.pp_size
        indices = local_stage_indices(cfg.pp_schedule, pp_rank, pp_size, cfg.pp_stages_per_rank)
        local = [(i, build_stage(model, stages[i])) for i in indices]
        self._model_ids |= {id(p) for p in model.parameters()}
        self._local_ids |= {id(p) for _, m in local for p in m.parameters()}
        _release_other_stages(model, self._local_ids)
        for _, module in local:  # in place: the Parameter objects (and an optimizer's references) stay
            module.to(self.state.device)
        self.mesh.data_parallel()  # collective on first use: made by every process here, in the same order
        group = self.mesh["pp"].get_group()
        last_owner = stage_owner(cfg.pp_schedule, cfg.pp_stages - 1, pp_size, cfg.pp_stages_per_rank)
        pipelined = PipelinedModel(local, cfg.pp_stages, cfg.pp_schedule, cfg.pp_microbatches, group, last_owner,
                                   self.state.device, loss_fn, lambda: self.gradient_state.num_steps,
                                   self._average_over_replicas)
        pipelined.full_state_names = set(model.state_dict())
        self._names.update({id(p): n for n, p in model.named_parameters()})
        self._params_by_name.update(dict(model.named_parameters()))
        self._models.append(pipelined)
        return pipelined

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model  # this process's stages; the full model exists on no process

    def release(self) -> None:
        self._models.clear()
        self._params_by_name.clear()  # references to every parameter of the prepared models

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Keep in ``optimizer`` only the parameters of this process's stages (and their state)."""
        from ..pipeline.model import record_group_names

        record_group_names(optimizer, [[self._names.get(id(p), "") for p in g["params"]] for g in optimizer.param_groups])
        for g, group in enumerate(optimizer.param_groups):
            kept = []
            for p in group["params"]:
                if id(p) not in self._model_ids:
                    raise ValueError(f"optimizer {type(optimizer).__name__}, parameter group {g}: a parameter of shape "
                                     f"{list(p.shape)} belongs to no model prepared for pipeline parallelism; pass the "
                                     "model to prepare() together with its optimizer (accelerator.prepare(model, "
                                     "optimizer)), and build the optimizer from that model's parameters")
                if id(p) in self._local_ids:
                    kept.append(p)
            group["params"] = kept
        for p in [p for p in optimizer.state if id(p) not in self._local_ids]:
            del optimizer.state[p]
        return optimizer

    # -- a training step ------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, accumulation_steps: int = 1, **kwargs: Any) -> None:
        """Nothing to do: the schedule ran backward inside ``model(...)``; checks ``loss`` is what it returned."""
        kinds = {m.loss_kind(loss) for m in self._models}
        if "trained" in kinds:
            return
        if "evaluated" in kinds:
            raise ValueError("accelerator.backward got the loss of a pipelined forward run under torch.no_grad(): the "
                             "schedule ran forward only, so there is nothing to differentiate; call the model with "
                             "autograd on (outside torch.no_grad()) to train")
        raise ValueError(
            "accelerator.backward got a loss that is not the outputs.loss the pipelined model returned: under pipeline "
            "parallelism backward already ran inside model(...) (torch's schedule) on the loss of the last stage, so "
            "a loss scaled or changed afterwards would not be the one differentiated. Pass outputs.loss unchanged "
            "(the division by gradient_accumulation_steps is already applied); to change the loss, give the function "
            "with hasten.pipeline.pipeline_loss(model, loss_fn) before prepare")

    def _average_over_replicas(self, model: PipelinedModel) -> None:
        """DDP's gradient average over the data-parallel replicas, on sync steps only."""
        if self.mesh.dp_size == 1 or not self.gradient_state.sync_gradients:
            return
        group = self.mesh.data_parallel().group
        for _, param in model.named_stage_parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)
                param.grad.div_(self.mesh.dp_size)

    def _total_norm(self, params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        norm_type = float(norm_type)
        if grads:
            local = torch.nn.utils.get_total_norm(grads, norm_type=norm_type).to(self.state.device, torch.float32)
        else:
            local = torch.zeros((), device=self.state.device)
        group = self.mesh["pp"].get_group()
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            return local
        powered = local.pow(norm_type)
        dist.all_reduce(powered, group=group)
        return powered.pow(1.0 / norm_type)

    def clip_grad_norm_(self, parameters: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every stage's gradients (the same total on every process, returned)."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        total = self._total_norm(params, norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def grad_norm(self, parameters: Params, norm_type: float = 2.0) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        return self._total_norm(params, norm_type)

    # -- state dict I/O -------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module, everyone: bool = True) -> dict[str, torch.Tensor]:
        """The full model's state dict (original names), gathered from every stage, on CPU; collective."""
        if not isinstance(model, PipelinedModel):
            return super().model_state_dict(model, everyone)
        mine = {k: v.detach().cpu() for k, v in model.stage_state_dict().items()}
        parts: list = [None] * self.parallelism_config.pp_size
        dist.all_gather_object(parts, mine, group=self.mesh["pp"].get_group())
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part)
        return full if everyone or self.state.process_index == 0 else {}

    def load_model_state_dict(self, model: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        if not isinstance(model, PipelinedModel):
            return super().load_model_state_dict(model, state_dict, strict)
        return model.load_stage_state_dict(state_dict, strict=strict)

    def saved_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: Any) -> Any:
        """A full optimizer state saved by one process (parameters numbered over the whole model, as
        the optimizer was built) cut to this process's parameters, numbered as its groups now hold them."""
        from ..pipeline.model import group_names

        full = group_names(optimizer)
        if (full is None or not isinstance(saved, dict) or "param_groups" not in saved or "state" not in saved
                or [len(g["params"]) for g in saved["param_groups"]] != [len(g) for g in full]):
            return saved  # not a state of this optimizer's full model: restorer.check_optimizer says what differs
        index = {name: pid for names, group in zip(full, saved["param_groups"])
                 for name, pid in zip(names, group["params"])}
        state, groups, at = {}, [], 0
        for names, live, group in zip(full, optimizer.param_groups, saved["param_groups"]):
            ids = {id(p) for p in live["params"]}
            mine = [n for n in names if id(self._params_by_name.get(n)) in ids]
            for j, name in enumerate(mine):
                if index[name] in saved["state"]:
                    state[at + j] = saved["state"][index[name]]
            groups.append(dict(group, params=list(range(at, at + len(mine)))))
            at += len(mine)
        return {"state": state, "param_groups": groups}


def _release_other_stages(model: nn.Module, local_ids: set[int]) -> None:
    """Empty the parameters of ``model`` that no local stage holds: this process never computes with
    them, and keeping them would cost every process the full model's weights (the point of a pipeline
    is that it does not). The Parameter objects stay (an optimizer built on them is filtered by
    identity afterwards); their data becomes an empty tensor of the same dtype and device."""
    for param in model.parameters():
        if id(param) not in local_ids:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _refuse_shared_across_stages(model: nn.Module, stages: list[list[str]]) -> None:
    """Tied weights (e.g. ``tie_word_embeddings``) on two stages would be two copies updated apart."""
    owner: dict[int, int] = {}
    for index, units in enumerate(stages):
        for unit in units:
            for name, param in model.get_submodule(unit).named_parameters():
                seen = owner.setdefault(id(param), index)
                if seen != index:
                    raise ValueError(f"pipeline parallelism: the parameter {unit}.{name} is shared by stages {seen} and "
                                     f"{index} (tied weights, e.g. tie_word_embeddings=True); untie them or use "
                                     "pp_split_points that keep the tied modules on one stage")
