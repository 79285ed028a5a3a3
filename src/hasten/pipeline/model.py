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

Batches of any size run (``batches``): the batch is completed to the shape torch's stages were built
for with rows the loss leaves out, so a last batch that ``pp_microbatches`` does not divide, or that
has fewer samples than microbatches, gives the one-process numbers; a right-padded LM batch (with its
``attention_mask``) too. The loss sees each microbatch as the range of rows ``[start, start + n)`` of
the step's batch: torch splits a target of row numbers (``torch.arange``) along with the inputs, so the
loss knows which microbatch it got and how many of its rows are real.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..activation_checkpointing import strip_checkpoint_prefix
from . import batches
from .schedule import build_schedule
from .split import DecoderStage
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
        self._decoder = all(isinstance(m, DecoderStage) for m in self.stage_modules)
        self._replicated = dist.get_world_size() > dist.get_world_size(group)  # data-parallel or tensor-parallel too
        self._build()  # built here so that a schedule torch does not know is refused at prepare
        self._layout: Optional[batches.Layout] = None  # the shape torch's stages were built for (None: not yet)
        self._step: dict[str, Any] = {}
        self._last_loss: Optional[torch.Tensor] = None
        self._last_trained = False  # whether the last forward ran backward (not under torch.no_grad())
        self.full_state_names: set[str] = set()  # every state dict key of the full model (set by the strategy)
        # Names of this process's tensors built on meta and given storage but no value yet (set by the strategy;
        # load_checkpoint_in_model and load_state remove what they fill): the model does not run while any is left.
        self.unfilled: set[str] = set()
        self.check_filled = False  # whether any process of the job had such tensors at prepare (then forward checks)

    def _build(self) -> None:
        """torch's stages and schedule over this process's stage modules; torch fixes their shapes on first use."""
        self._pipe_stages = [TrackedStage(self._tracker, module, index, self.num_stages, self._device, group=self._group)
                             for index, module in self.local_stages()]
        self._schedule = build_schedule(self.schedule_name, self._pipe_stages, self.microbatches, self._microbatch_loss)
        self._schedule_mode: Optional[bool] = None  # whether the schedule last ran backward (None: never ran)

    # -- what the stages hold, under the original names ---------------------------------------
    def local_stages(self) -> list[tuple[int, nn.Module]]:
        return list(zip(self.stage_indices, self.stage_modules))

    def named_stage_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This process's parameters under their names in the full model (without checkpoint wrappers' part)."""
        for module in self.stage_modules:
            for name, param in module.named_parameters():
                yield strip_checkpoint_prefix(name), param

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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import DTensor

        for module in self.stage_modules:
            mine = module.state_dict()
            missing = [k for k in mine if k not in state_dict]
            if strict and missing:
                raise KeyError(f"the state dict lacks {len(missing)} entries of pipeline stage(s) {self.stage_indices}, "
                               f"e.g. {missing[:3]}")
            given = {k: state_dict[k] for k in mine if k in state_dict}
            if any(isinstance(mine[k], DTensor) and not isinstance(v, DTensor) for k, v in given.items()):
                # nn.Module.load_state_dict cannot copy into shards; torch's full-state-dict load keeps each its part
                set_model_state_dict(module, given, options=StateDictOptions(full_state_dict=True, strict=False))
            else:
                module.load_state_dict(given, strict=False)
            self.filled(given)

    def filled(self, names: Any) -> None:
        """The tensors of ``names`` now hold values (a load wrote them): no longer unfilled."""
        self.unfilled.difference_update(names)

    # -- a step -------------------------------------------------------------------------------
    def _microbatch_loss(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The loss of one microbatch, normalised over the step's batch; ``rows``: its row numbers in the step's
        (completed) batch, a range: the rows from ``samples`` on are completion and count nowhere."""
        step = self._step
        start, size = int(rows[0]), rows.shape[0]
        real = max(0, min(step["samples"] - start, size))
        if self._user_loss is not None:
            if real == 0:  # completion only: no loss, a zero gradient for the schedule to send back
                part = output.sum() * 0.0
            else:
                out = output[:real] if real < size else output
                if self._decoder and out.shape[1] != step["length"]:
                    out = out[:, :step["length"]]
                part = self._user_loss(out, step["labels"][start:start + real]) * (real / step["samples"])
        else:  # a decoder LM: shifted token cross entropy over the whole batch's counted tokens
            labels = step["labels"][start:start + size]  # completed with -100
            shifted = nn.functional.pad(labels, (0, 1), value=batches.IGNORE)[..., 1:]
            logits = output.float()
            part = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                               ignore_index=batches.IGNORE, reduction="sum") / step["tokens"]
        # By microbatch: torch's first step also calls the loss on microbatch 0 to infer shapes; the real call follows.
        step["parts"][start // size] = part.detach()
        return part / step["accumulation"]

    def _refuse_unfilled(self) -> None:
        """Refuse to run while any process of the job holds tensors built on meta and never given a value: one
        all-reduce over the job (only until every process is filled), so that every process refuses together and
        none is left waiting in the schedule for a stage that refused."""
        left = torch.tensor([len(self.unfilled)], device=self._device)
        dist.all_reduce(left)
        if int(left.item()) == 0:
            self.check_filled = False
            return
        mine = sorted(self.unfilled)
        here = (f"this process's stage(s) {self.stage_indices} lack {len(mine)}, e.g. {mine[:3]}" if mine
                else "this process's stages are filled")
        raise ValueError(f"pipeline parallelism: {int(left.item())} tensor(s) built on the meta device have no values yet "
                         f"({here}); call hasten.load_checkpoint_in_model(model, folder) with the prepared model (each "
                         "stage reads its own layers), or accelerator.load_state(folder), before the first step")

    def forward(self, *args: Any, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                target: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> PipelineOutput:
        if self.check_filled:
            self._refuse_unfilled()
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
        first, last = 0 in self.stage_indices, self.num_stages - 1 in self.stage_indices
        if first and inputs is None:
            raise ValueError("the process that runs the first pipeline stage needs the inputs: model(inputs, labels=...)")
        refusal = self._refusal(inputs, labels, attention_mask)
        # Backward runs whenever autograd is on (model.eval() only switches dropout off, as elsewhere);
        # under torch.no_grad() the schedule's forward-only eval runs.
        training = torch.is_grad_enabled()
        self._tracker.begin()
        try:
            mine = (batches.wanted(labels.shape[0], self.microbatches, labels, inputs, self._decoder)
                    if refusal is None else batches.Layout(1, 0, -1))
            if self._replicated:  # other pipelines read other batches: one all_reduce of five integers
                self._tracker.doing("agreeing on the batch shape with every process")
                agreed, refused = batches.agree(mine, refusal is not None, self._device)
            else:  # every process of the pipeline has the same batch: the same decision, without a collective
                known = self._layout.tail if self._layout is not None else -1
                agreed, refused = (mine if mine.tail >= 0 else batches.Layout(mine.rows, mine.length, known)), False
            if refusal is not None or refused:  # every process raises, none waits for the others
                raise ValueError(refusal or "pipeline parallelism: another process refused its batch of this step "
                                            "(its error says why); this process stops with it")
            layout = agreed if self._layout is None else self._layout.grown(agreed)
            if self._layout is not None and layout != self._layout:
                self._build()  # a larger shape than torch's stages were built for: build them again
            self._layout = layout
            out, loss = self._run(inputs if first else None, labels, last, training)
        except BaseException as error:
            self._tracker.annotate(error)
            raise
        finally:
            self._tracker.end()
            self._step = {}
        if training:
            self._after_backward(self)
        else:  # evaluation: every stage gets the predictions (gather_for_metrics then works as elsewhere)
            out = self._share(out if last else None)
        self._last_loss, self._last_trained = loss, training
        return PipelineOutput(loss=loss, logits=out if last or not training else None)

    def _refusal(self, inputs: Optional[torch.Tensor], labels: torch.Tensor,
                 attention_mask: Optional[torch.Tensor]) -> Optional[str]:
        """Why this batch cannot give the one-process numbers, or None."""
        if labels.ndim == 0 or labels.shape[0] == 0:
            return f"pipeline parallelism: a batch of labels of shape {list(labels.shape)} holds no sample"
        if inputs is not None and inputs.shape[0] != labels.shape[0]:
            return (f"pipeline parallelism: the inputs hold {inputs.shape[0]} samples and the labels "
                    f"{labels.shape[0]}; give both for the same samples")
        if self._decoder and (labels.ndim != 2 or (
                inputs is not None and tuple(inputs.shape) != tuple(labels.shape))):
            return (f"a decoder LM under pipeline parallelism takes input_ids and labels of the same shape (batch, "
                    f"tokens); got labels {list(labels.shape)}"
                    + (f" and input_ids {list(inputs.shape)}" if inputs is not None else ""))
        if attention_mask is not None:
            return batches.refused_padding(attention_mask, labels, self._decoder)
        return None

    def _run(self, inputs: Optional[torch.Tensor], labels: torch.Tensor, last: bool,
             training: bool) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """One schedule step over the batch completed to ``self._layout``: the last stage's output (its rows
        and tokens only) and the batch's loss (equal on every process of the pipeline)."""
        layout, samples = self._layout, labels.shape[0]
        rows = layout.rows * self.microbatches
        length = labels.shape[1] if self._decoder else 0
        step_labels, tokens = labels, None
        if last and self._user_loss is None:
            tokens = (nn.functional.pad(labels, (0, 1), value=batches.IGNORE)[..., 1:] != batches.IGNORE).sum()
            step_labels = batches.padded_labels(labels, rows, layout.length)
        self._step = {"samples": samples, "length": length, "labels": step_labels, "tokens": tokens,
                      "parts": [None] * self.microbatches, "accumulation": self._accumulation_steps() if training else 1}
        step_args = (batches.completed(inputs, rows, layout.length),) if inputs is not None else ()
        # The target torch splits into microbatches: row numbers (see _microbatch_loss); on the CPU, read without sync.
        step_kwargs = {"target": torch.arange(rows), "losses": []} if last else {}
        run = self._schedule.step if training else self._schedule.eval
        # torch builds its stages on a schedule's first step and again when it switches between step and eval;
        # gradients accumulated so far are set aside meanwhile (it sets FSDP2 modules' gradients to None after).
        taken = self._take_grads() if self._schedule_mode != training else []
        try:
            out = run(*step_args, **step_kwargs)
        finally:
            self._give_back_grads(taken)
        self._schedule_mode = training
        if last:  # the unscaled loss of the batch: the sum of the microbatches' parts torch differentiated
            loss = torch.stack(self._step["parts"]).sum()
            out = out[:samples] if out.shape[0] != samples else out
            if length and out.shape[1] != length:
                out = out[:, :length]
        else:
            loss, out = torch.zeros((), device=self._device), None
        loss = loss.detach().to(self._device, torch.float32)
        self._tracker.doing("broadcasting the loss from the last stage")
        dist.broadcast(loss, src=dist.get_global_rank(self._group, self._last_owner), group=self._group)
        return out, loss

    def _take_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        taken = []
        for _, param in self.named_stage_parameters():
            if param.grad is not None:
                taken.append((param, param.grad))
                param.grad = None
        return taken

    @staticmethod
    def _give_back_grads(taken: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        for param, grad in taken:
            param.grad = grad if param.grad is None else param.grad + grad

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
