"""The prepared pipelined model: ``model(**batch)`` runs torch's schedule over the microbatches.

Why backward happens inside forward: a pipeline schedule interleaves the forwards and backwards
of its microbatches (1F1B, zero bubble), so there is no point where "the loss" exists before any
backward ran. ``forward`` therefore runs the schedule's whole ``step`` (forwards, loss, backwards)
and returns the loss for logging; ``accelerator.backward(outputs.loss)`` is then a no-op that only
checks it was given that very tensor, so a loss scaled or changed before backward is an error
rather than a silent difference from the one-process loop.

The loss is normalised over the global batch, so the numbers equal the one-process loop's:

* a transformers decoder LM (no loss function given): the sum of the per-token cross entropies of
  a microbatch (labels shifted by one, ``-100`` ignored) divided by the number of counted tokens in
  the *whole* batch, not the microbatch: microbatches with more tokens weigh more, exactly as in
  ``model(input_ids, labels=labels).loss`` over the whole batch;
* any other model: ``loss_fn(output, target)`` given once with ``pipeline_loss(model, loss_fn)``,
  which must return the *mean* over the microbatch's samples; each microbatch is weighted by its
  share of the batch's samples.

Each microbatch loss is also divided by the gradient-accumulation steps (what ``accelerator.backward``
does in the other strategies), since its backward runs here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .schedule import build_schedule
from .tracking import StepTracker, TrackedStage

# model -> the loss its last stage computes (``pipeline_loss``); weak: forgotten with the model.
_LOSSES: "weakref.WeakKeyDictionary[nn.Module, Callable]" = weakref.WeakKeyDictionary()
# optimizer -> the original names of every parameter of each of its groups in the full model (recorded
# before prepare keeps only this process's): what a checkpoint stores as the groups' ``params``, the
# same on every process, so any layout maps the groups back (``hasten.checkpointing.sharded``).
_GROUP_NAMES: "weakref.WeakKeyDictionary[Any, list[list[str]]]" = weakref.WeakKeyDictionary()


def record_group_names(optimizer: Any, names: list[list[str]]) -> None:
    _GROUP_NAMES[optimizer] = names


def group_names(optimizer: Any) -> Optional[list[list[str]]]:
    """The full model's parameter names of each group of ``optimizer`` (None: not prepared for a pipeline)."""
    return _GROUP_NAMES.get(optimizer)


def pipeline_loss(model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> nn.Module:
    """Give ``model`` the loss the last pipeline stage computes, before ``accelerator.prepare(model)``.

    ``loss_fn(output, target)`` gets the last stage's output and the labels of one microbatch and
    returns the mean loss over its samples (e.g. ``torch.nn.functional.mse_loss``). A transformers
    decoder LM needs none: its shifted cross entropy over the non-``-100`` labels is built in.
    Returns ``model``."""
    if not callable(loss_fn):
        raise TypeError(f"pipeline_loss: loss_fn must be callable (output, target) -> loss, got {type(loss_fn).__name__}")
    _LOSSES[model] = loss_fn  # beside the model: no attribute, parameter or state dict entry added to it
    return model


def given_loss(model: nn.Module) -> Optional[Callable]:
    return _LOSSES.get(model)


@dataclass
class PipelineOutput:
    """What the pipelined model returns: ``loss`` (the global batch's, equal on every stage) and
    ``logits`` (the last stage's output): in training on the process that runs the last stage only
    (None elsewhere), under ``torch.no_grad()`` on every process of the pipeline."""

    loss: torch.Tensor
    logits: Optional[torch.Tensor] = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


class PipelinedModel(nn.Module):
    """The stages this process runs (``stage_modules``, original parameter names) and the schedule over them.

    Built by ``PipelineStrategy.wrap_model``; see the module docstring for ``forward``."""

    def __init__(self, stages: list[tuple[int, nn.Module]], num_stages: int, schedule: str, microbatches: int,
                 group: Any, last_owner: int, device: torch.device, loss_fn: Optional[Callable],
                 accumulation_steps: Callable[[], int], after_backward: Callable[["PipelinedModel"], None]) -> None:
        super().__init__()
        self.stage_modules = nn.ModuleList([module for _, module in stages])
        self.stage_indices = [index for index, _ in stages]
        self.num_stages, self.microbatches, self.schedule_name = num_stages, microbatches, schedule
        self._group, self._last_owner, self._device = group, last_owner, device
        self._user_loss, self._accumulation_steps, self._after_backward = loss_fn, accumulation_steps, after_backward
        # hang and failure reports name the stage and the action (TrackedStage: torch's PipelineStage, reporting)
        self._tracker = StepTracker(self.stage_indices, num_stages, dist.get_rank(group), dist.get_world_size(group),
                                    schedule)
        self._pipe_stages = [TrackedStage(self._tracker, module, index, num_stages, device, group=group)
                             for index, module in stages]
        self._schedule = build_schedule(schedule, self._pipe_stages, microbatches, self._microbatch_loss)
        self._step: dict[str, Any] = {}
        self._last_loss: Optional[torch.Tensor] = None
        self._last_trained = False  # whether the last forward ran backward (not under torch.no_grad())
        self.full_state_names: set[str] = set()  # every state dict key of the full model (set by the strategy)

    # -- what the stages hold, under the original names ---------------------------------------
    def local_stages(self) -> list[tuple[int, nn.Module]]:
        return list(zip(self.stage_indices, self.stage_modules))

    def named_stage_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This process's parameters under their names in the full model."""
        for module in self.stage_modules:
            yield from module.named_parameters()

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This process's part of the full model's state dict (original names)."""
        out: dict[str, torch.Tensor] = {}
        for module in self.stage_modules:
            out.update(module.state_dict())
        return out

    def load_stage_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load this process's entries of a state dict (``strict``: each must be there): full tensors (a one-process
        checkpoint), of which a stage sharded by FSDP2 or tensor parallelism keeps its own shards, or tensors laid
        out as the stage's own (DCP read into them)."""
        from torch.distributed.tensor import DTensor

        from ..strategies.sharded_state import load_full_state_dict

        for module in self.stage_modules:
            mine = module.state_dict()
            missing = [k for k in mine if k not in state_dict]
            if strict and missing:
                raise KeyError(f"the state dict lacks {len(missing)} entries of pipeline stage(s) {self.stage_indices}, "
                               f"e.g. {missing[:3]}")
            given = {k: state_dict[k] for k in mine if k in state_dict}
            if any(isinstance(mine[k], DTensor) and not isinstance(v, DTensor) for k, v in given.items()):
                load_full_state_dict(module, given, strict=False)  # nn.Module.load_state_dict cannot copy into shards
            else:
                module.load_state_dict(given, strict=False)

    # -- a step -------------------------------------------------------------------------------
    def _microbatch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        step = self._step
        if self._user_loss is not None:
            part = self._user_loss(output, target) * (target.shape[0] / step["samples"])
        else:  # a decoder LM: shifted token cross entropy over the whole batch's counted tokens
            shifted = nn.functional.pad(target, (0, 1), value=-100)[..., 1:]
            logits = output.float()
            part = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                               ignore_index=-100, reduction="sum") / step["tokens"]
        scaled = part / step["accumulation"]
        # Keyed by the tensor handed to torch: its first step may call the loss once more, to infer shapes.
        step["parts"][id(scaled)] = (scaled, part.detach())
        return scaled

    def forward(self, *args: Any, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                target: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> PipelineOutput:
        if kwargs:
            raise TypeError(f"the pipelined model takes the inputs (positional, or input_ids=) and labels= only; got "
                            f"{sorted(kwargs)}: the first stage receives only the inputs, later stages only the previous "
                            "stage's output")
        if len(args) > 1 or (args and input_ids is not None):
            raise TypeError("the pipelined model takes one input tensor (positional, or input_ids=) and labels=")
        inputs = input_ids if input_ids is not None else (args[0] if args else None)
        labels = labels if labels is not None else target
        if labels is None:
            raise ValueError("under pipeline parallelism the model computes the loss on its last stage: call "
                             "model(inputs, labels=labels) (or model(input_ids=..., labels=...)) on every process")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("pipeline parallelism does not pass an attention_mask between stages yet: padded batches "
                             "are not supported; pack the sequences (no padding) or use pp_size=1")
        samples = labels.shape[0]
        if samples % self.microbatches:
            raise ValueError(f"pipeline parallelism: a batch of {samples} samples does not split into pp_microbatches="
                             f"{self.microbatches} equal microbatches; use a batch size that is a multiple of "
                             f"{self.microbatches} (drop_last=True in the DataLoader keeps the last batch full)")
        first, last = 0 in self.stage_indices, self.num_stages - 1 in self.stage_indices
        if first and inputs is None:
            raise ValueError("the process that runs the first pipeline stage needs the inputs: model(inputs, labels=...)")
        # Backward runs whenever autograd is on (model.eval() only switches dropout off, as elsewhere);
        # under torch.no_grad() the schedule's forward-only eval runs.
        training = torch.is_grad_enabled()
        tokens = None
        if self._user_loss is None:
            tokens = (nn.functional.pad(labels, (0, 1), value=-100)[..., 1:] != -100).sum()
        self._step = {"samples": samples, "tokens": tokens, "parts": {},
                      "accumulation": self._accumulation_steps() if training else 1}
        step_args = (inputs,) if first else ()
        losses: list = []
        step_kwargs = {"target": labels, "losses": losses} if last else {}
        run = self._schedule.step if training else self._schedule.eval
        self._tracker.begin()
        try:
            out = run(*step_args, **step_kwargs)
            if last:  # the unscaled global-batch loss: the sum of the microbatches' parts torch differentiated
                loss = torch.stack([self._step["parts"][id(scaled)][1] for scaled in losses]).sum()
            else:
                loss = torch.zeros((), device=self._device)
            loss = loss.detach().to(self._device, torch.float32)
            self._tracker.doing("broadcasting the loss from the last stage")
            dist.broadcast(loss, src=dist.get_global_rank(self._group, self._last_owner), group=self._group)
        except BaseException as error:
            self._tracker.annotate(error)
            raise
        finally:
            self._tracker.end()
        if training:
            self._after_backward(self)
        else:  # evaluation: every stage gets the predictions (gather_for_metrics then works as elsewhere)
            out = self._share(out if last else None)
        self._last_loss, self._last_trained = loss, training
        self._step = {}
        return PipelineOutput(loss=loss, logits=out if last or not training else None)

    def _share(self, out: Optional[torch.Tensor]) -> torch.Tensor:
        """The last stage's output, broadcast to every process of the pipeline (shape and dtype first)."""
        src = dist.get_global_rank(self._group, self._last_owner)
        meta = [(tuple(out.shape), out.dtype) if out is not None else None]
        dist.broadcast_object_list(meta, src=src, group=self._group)
        shape, dtype = meta[0]
        buf = out.detach().contiguous() if out is not None else torch.empty(shape, dtype=dtype, device=self._device)
        dist.broadcast(buf, src=src, group=self._group)
        return buf

    def loss_kind(self, loss: Any) -> Optional[str]:
        """"trained" when ``loss`` is the very tensor the last ``forward`` returned after running
        backward, "evaluated" when that forward ran under ``torch.no_grad()``, else None."""
        if self._last_loss is None or loss is not self._last_loss:
            return None
        return "trained" if self._last_trained else "evaluated"
