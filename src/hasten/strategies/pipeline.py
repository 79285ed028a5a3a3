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
  of each sync step (DDP's result; accumulation micro-steps and ``no_sync`` skip it, as DDP's);
* with ``tp_size`` > 1 and/or ``dp_shard_size`` > 1 (FSDP2), each stage module gets the
  tensor-parallel plan, then ``fully_shard`` per block and on the stage, over the stage's sub-meshes
  (torchtitan's order); FSDP2 then reduces the gradients, and clipping counts each shard once;
* ``mixed_precision="bf16"``: autocast around each stage's forward (fp16 is refused).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..activation_checkpointing import strip_checkpoint_prefix
from ..pipeline.model import PipelinedModel, given_loss
from ..pipeline.schedule import local_stage_indices, stage_owner
from ..pipeline.split import DecoderStage, build_stage, model_kind, plan_stages
from ..precision import Precision
from ..utils.dataclasses import DistributedType
from .base import Params, Strategy
from .dtensor import _finish, _local, _partial_norm, _replicas
from .expert_parallel import fully_shard_experts, refuse_router_aux_loss
from .layout_steps import lay_out, tensor_plan
from .mesh import ParallelMesh


class PipelineStrategy(Strategy):
    """``ParallelismConfig(pp_size=N[, dp_replicate_size, dp_shard_size, tp_size])``: pipeline stages over N processes."""

    # Each process writes its own stages' parameters and optimizer state as DCP shards, under the
    # original names (``hasten.checkpointing.sharded`` asks the PipelinedModel for them): any layout reads them.
    checkpoint_format = "dcp"
    # prepare must not move the whole model to the GPU first: only this process's stages go there.
    places_model_itself = True

    def __init__(self, plan: Any) -> None:
        self.parallelism_config = plan.parallelism_config
        self.gradient_state = plan.gradient_state
        # Keyed by the parameter objects themselves (hashed by identity; held strongly, as _params_by_name holds them
        # anyway, and dropped by release(): a weak reference would stop torch from swapping a tensor in place, as
        # FSDP2's to_empty does): the parameters of the prepared models -> their original name; those this process's
        # stages hold -> the live parameter (a DTensor replacement, or itself).
        self._names: dict[nn.Parameter, str] = {}
        self._live: dict[nn.Parameter, nn.Parameter] = {}
        self._models: list[PipelinedModel] = []
        self._params_by_name: dict[str, nn.Parameter] = {}  # the live parameter (this process's, or released) by name
        self._sharded = plan.parallelism_config.dp_shard_size > 1 or plan.distributed_type == DistributedType.FSDP
        super().__init__(plan)
        self.distributed_type = plan.distributed_type
        cfg = self.parallelism_config
        if cfg.cp_size > 1:
            raise ValueError(f"ParallelismConfig: pp_size={cfg.pp_size} with cp_size={cfg.cp_size} is not supported "
                             "yet; pipeline parallelism composes with dp_replicate_size, dp_shard_size (FSDP2) and "
                             "tp_size (set cp_size=1)")
        plugin = getattr(plan, "fsdp_plugin", None)
        if plan.distributed_type == DistributedType.DEEPSPEED or (
                plan.distributed_type == DistributedType.FSDP and getattr(plugin, "fsdp_version", 2) != 2):
            raise ValueError(f"ParallelismConfig: pp_size={cfg.pp_size} with {plan.distributed_type} is not supported; "
                             "use FullyShardedDataParallelPlugin(fsdp_version=2) with dp_shard_size, or "
                             "dp_replicate_size, for data parallelism")
        if plan.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"pipeline parallelism with mixed_precision={plan.mixed_precision!r} is not supported; "
                             "use mixed_precision='bf16' (no loss scaling needed) or 'no'")
        self.fsdp_plugin = plugin
        self._no_sync = 0  # depth of no_sync() blocks entered

    def build_precision(self, mode: str, scaler_kwargs: Any, autocast_kwargs: Any) -> Precision:
        return _StagePrecision(mode, self.state.device, scaler_kwargs, autocast_kwargs)

    def build_mesh(self) -> ParallelMesh:
        # FSDP2 on the stages needs a shard dimension, also of size 1 (an FSDP plugin with pp x tp, e.g. for ep)
        keep = ("dp_shard",) if self._sharded else ()
        return ParallelMesh(self.parallelism_config.sizes(), self.state.process_index, self.state.num_processes,
                            self.state.device.type, keep=keep, ep=self.parallelism_config.ep_size)

    # -- the model ------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        cfg = self.parallelism_config
        kind = model_kind(model)
        stages = plan_stages(model, cfg.pp_stages, cfg.pp_split_points)  # refused here, before any collective
        _refuse_shared_across_stages(model, stages)
        refuse_router_aux_loss(model)
        loss_fn = given_loss(model)
        if loss_fn is None and kind != "decoder":
            raise ValueError(f"pipeline parallelism: the last stage of this {type(model).__name__} computes the loss, "
                             "so it needs the loss function: call hasten.pipeline.pipeline_loss(model, loss_fn) "
                             "before accelerator.prepare(model) (loss_fn(output, target) -> mean over the samples)")
        pp_rank, pp_size = self.mesh.coordinates()["pp"], cfg.pp_size
        indices = local_stage_indices(cfg.pp_schedule, pp_rank, pp_size, cfg.pp_stages_per_rank)
        if self.mesh.sizes["tp"] > 1:  # every key must name modules of the full model (before the others go)
            tensor_plan(self.layout_target(model, whole=model))
        local = [(i, build_stage(model, stages[i])) for i in indices]
        originals = {name: p for _, m in local for name, p in m.named_parameters()}
        _release_other_stages(model, set(originals.values()))
        meta_buffers: set[str] = set()
        for _, module in local:  # in place: the Parameter objects (and an optimizer's references) stay, unless on meta
            meta_buffers |= _place_stage(module, self.state.device)
        for _, module in local:  # the layout steps each stage needs: tensor plan, checkpointing, FSDP2
            lay_out(self.layout_target(module, whole=model))
        live_by_name = {strip_checkpoint_prefix(n): p for _, m in local for n, p in m.named_parameters()}
        for name, old in originals.items():
            live = live_by_name[name]
            self._live[old] = live
            self._live[live] = live
            if live is not old:  # replaced (a DTensor, or storage for a meta one): optimizers built on ``old`` are re-pointed
                old.data = torch.empty(0, dtype=old.dtype, device=old.device)
        for _, module in local:
            self.precision.wrap_stage(module)
        self.mesh.data_parallel()  # collective on first use: made by every process here, in the same order
        group = self.mesh["pp"].get_group()
        last_owner = stage_owner(cfg.pp_schedule, cfg.pp_stages - 1, pp_size, cfg.pp_stages_per_rank)
        pipelined = PipelinedModel(local, cfg.pp_stages, cfg.pp_schedule, cfg.pp_microbatches, group, last_owner,
                                   self.state.device, loss_fn, lambda: self.gradient_state.num_steps,
                                   self._average_over_replicas)
        if self._sharded and self.gradient_state.num_steps > 1:
            warnings.warn("pipeline parallelism with FSDP2: gradients are reduce-scattered after every "
                          f"accumulation step (gradient_accumulation_steps={self.gradient_state.num_steps}), not "
                          "only at the sync step: torch's pipeline schedule turns FSDP2's gradient sync on for each "
                          "step (PipelineStage.perform_reduce_grad). The numbers are the same; only the traffic grows",
                          stacklevel=2)
        pipelined.full_state_names = set(model.state_dict())
        pipelined.unfilled = {n for n, old in originals.items() if old.is_meta} | meta_buffers
        anywhere = torch.tensor([len(pipelined.unfilled)], device=self.state.device)
        dist.all_reduce(anywhere)  # prepare runs on every process: whether any process built on meta
        pipelined.check_filled = bool(anywhere.item())
        for name, p in model.named_parameters():
            self._names[p] = name
            self._params_by_name[name] = self._live.get(p, p)
        self._models.append(pipelined)
        return pipelined

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model  # this process's stages; the full model exists on no process

    def release(self) -> None:
        self._models.clear()
        self._params_by_name.clear()  # references to every parameter of the prepared models
        self._names.clear()
        self._live.clear()

    def sharding(self) -> Any:
        """FSDP2 on each stage (with ``dp_shard_size`` > 1 or an FSDP plugin): per block, then the stage, over
        the stage's data-parallel sub-mesh. Not resharded after forward (torchtitan's choice under a
        pipeline): each microbatch's forward would all-gather the blocks again; they are resharded after
        the step's backward."""
        if not self._sharded:
            return None

        def shard_stage(stage: nn.Module) -> None:
            from torch.distributed.fsdp import fully_shard

            dims = ("dp_replicate", "dp_shard") if self.mesh.sizes["dp_replicate"] > 1 else "dp_shard"
            kwargs = dict(mesh=self.mesh[dims], reshard_after_forward=False)
            fully_shard_experts(stage, self.mesh, **kwargs)  # split over ep: first, on the experts' own mesh
            for block in stage_blocks(stage):
                fully_shard(block, **kwargs)
            fully_shard(stage, **kwargs)

        return shard_stage

    def checkpoint_targets(self, model: nn.Module) -> list[nn.Module]:
        """A stage's blocks (an nn.Sequential's children, a decoder's layers), unless block classes are named."""
        if self.activation_checkpointing.block_classes:
            return super().checkpoint_targets(model)
        return stage_blocks(model)

    def no_sync(self, model: nn.Module) -> Any:
        """As DDP's: backward inside does not average gradients over the data-parallel replicas."""
        import contextlib

        @contextlib.contextmanager
        def off() -> Any:
            self._no_sync += 1
            try:
                yield
            finally:
                self._no_sync -= 1

        return off()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Keep in ``optimizer`` only the parameters of this process's stages (and their state)."""
        from ..pipeline.model import record_group_names

        record_group_names(optimizer, [[self._names.get(p, "") for p in g["params"]] for g in optimizer.param_groups])
        for g, group in enumerate(optimizer.param_groups):
            kept = []
            for p in group["params"]:
                if p not in self._names and p not in self._live:
                    raise ValueError(f"optimizer {type(optimizer).__name__}, parameter group {g}: a parameter of shape "
                                     f"{list(p.shape)} belongs to no model prepared for pipeline parallelism; pass the "
                                     "model to prepare() together with its optimizer (accelerator.prepare(model, "
                                     "optimizer)), and build the optimizer from that model's parameters")
                if p in self._live:
                    kept.append(self._live[p])
            group["params"] = kept
        for p in list(optimizer.state):
            state = optimizer.state.pop(p)
            if p in self._live:
                optimizer.state[self._live[p]] = state
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
        if self.mesh.dp_size == 1 or self._sharded or self._no_sync or not self.gradient_state.sync_gradients:
            return  # FSDP2 reduces its gradients itself
        group = self.mesh.data_parallel().group
        for _, param in model.named_stage_parameters():
            if param.grad is not None:
                grad = _local(param.grad)
                dist.all_reduce(grad, group=group)
                grad.div_(self.mesh.dp_size)

    def _total_norm(self, params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The norm over every stage and shard: each process adds its local shards, each element divided by
        how many processes of its stage hold it (replicas, tp copies), then one all-reduce over the job."""
        grads = [p.grad for p in params if p.grad is not None]
        norm_type = float(norm_type)
        per_stage = self.state.num_processes // self.parallelism_config.pp_size
        total = _partial_norm(grads, [_replicas(g, per_stage) for g in grads], norm_type, self.state.device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
        return _finish(total, norm_type)

    def clip_grad_norm_(self, parameters: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every stage's gradients (the same total on every process, returned)."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        total = self._total_norm(params, norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                grad = _local(p.grad)
                grad.mul_(coef.to(grad.device, grad.dtype))
        return total

    def grad_norm(self, parameters: Params, norm_type: float = 2.0) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        return self._total_norm(params, norm_type)

    # -- state dict I/O -------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module, everyone: bool = True) -> dict[str, torch.Tensor]:
        """The full model's state dict (original names), gathered from every stage, on CPU; collective."""
        if not isinstance(model, PipelinedModel):
            return super().model_state_dict(model, everyone)
        mine = {k: _full(v).detach().cpu() for k, v in model.stage_state_dict().items()}
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
            held = set(live["params"])  # the parameter objects (hashed by identity)
            # a parameter FSDP2 / tensor parallelism replaced holds its place under its original name
            mine = [n for n in names if self._params_by_name.get(n) in held]
            for j, name in enumerate(mine):
                if index[name] in saved["state"]:
                    state[at + j] = saved["state"][index[name]]
            groups.append(dict(group, params=list(range(at, at + len(mine)))))
            at += len(mine)
        return {"state": state, "param_groups": groups}


def _release_other_stages(model: nn.Module, local: set) -> None:
    """Empty the parameters of ``model`` that no local stage holds: this process never computes with
    them, and keeping them would cost every process the full model's weights (the point of a pipeline
    is that it does not). The Parameter objects stay (an optimizer built on them is filtered by
    identity afterwards); their data becomes an empty tensor of the same dtype and device."""
    for param in model.parameters():
        if param not in local:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _place_stage(stage: nn.Module, device: torch.device) -> set[str]:
    """Move ``stage`` to ``device`` in place. Parameters (and persistent buffers) built on ``meta`` (a model too large
    for one process, built under ``init_empty_weights()``) get uninitialised storage on ``device`` instead: new
    Parameters (the strategy re-points optimizers at them), to be filled by ``load_checkpoint_in_model(prepared, folder)``
    or ``load_state``; the pipelined model refuses to run until they are. Returns the names of such buffers."""
    made: dict = {}  # meta parameter -> its replacement, so a weight two modules of the stage share stays shared
    buffers: set[str] = set()
    for prefix, module in stage.named_modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if param not in made:
                    made[param] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                               requires_grad=param.requires_grad)
                setattr(module, name, made[param])
        for name, buffer in list(module._buffers.items()):
            if buffer is None or not buffer.is_meta:
                continue
            full = strip_checkpoint_prefix(f"{prefix}.{name}" if prefix else name)
            if name in module._non_persistent_buffers_set:
                raise ValueError(f"pipeline parallelism: the buffer {full} is on the meta device and is never saved in a "
                                 "checkpoint (non-persistent), so nothing could give it a value; build the model under "
                                 "init_empty_weights() without include_buffers=True (buffers are then computed as usual)")
            module.register_buffer(name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
            buffers.add(full)
    stage.to(device)
    return buffers


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


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 / tensor-parallel shard) gathered whole (collective over its mesh); else as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def stage_blocks(stage: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a stage, which FSDP2 shards as their own groups and activation checkpointing
    wraps: an nn.Sequential's children, a decoder's layers (the embedding, norm and head stay with the stage)."""
    if not isinstance(stage, DecoderStage):
        return list(stage.children())
    return [layer for module in stage.modules() if isinstance(module, nn.ModuleDict) for layer in module.values()]


class _StagePrecision(Precision):
    """bf16 under a pipeline: autocast around each stage's forward (its output handed on in fp32, which is
    exact for bf16 values), not around the whole schedule (which runs backward too)."""

    def wrap_forward(self, model: nn.Module) -> None:
        return None  # the full model is cut after this; its stages are wrapped instead

    def wrap_stage(self, stage: nn.Module) -> None:
        Precision.wrap_forward(self, stage)
