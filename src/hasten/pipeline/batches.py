"""The shape of a pipelined step: batches of any size, and right-padded language-model batches.

torch's pipeline stages fix the shape of what they send and receive when they are first run
(``PipelineStage`` allocates its receive buffers from the first microbatch): a later batch of
another shape would be received into buffers of the old one (torch 2.13 + gloo: a crash in backward
or, under ``torch.no_grad()``, predictions and loss of the wrong rows without any error), and a
batch that ``pp_microbatches`` does not divide cannot be cut into equal microbatches at all. So
every step runs at one ``Layout``, the shape the stages were built for:

* rows: the batch is completed to ``rows * pp_microbatches`` rows with copies of its own rows
  (always valid inputs), which the loss leaves out: they add nothing to the loss or the gradients.
  A smaller batch (the last one of an epoch) runs in the layout already built; a larger one makes
  a new layout, and ``PipelinedModel`` builds torch's stages again (once per new shape);
* length (decoder LMs): token ids are completed on the right with token 0 and labels ``-100`` up to
  the longest sequence seen: under the causal mask no real token sees a later one, and ``-100``
  counts nowhere, so the loss and the gradients are those of the unpadded batch;
* the inputs' other dimensions (an ``nn.Sequential``'s features): a change builds a new layout;
  they cannot be completed.

The processes of one pipeline must build the same buffers. They get the same batch, so each decides
alone (a process without the inputs takes their other dimensions as unchanged). With data-parallel
replicas, whose batches differ, every process of the job agrees on the layout with one ``all_reduce``
(MAX) of five integers per step: the replicas must build their stages at the same steps, since FSDP2
gathers parameters while torch builds them, and a batch refused on one process stops every process.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

IGNORE = -100
_ABSENT = -(2 ** 62)  # what a process without inputs contributes to the agreement on their shape


@dataclass(frozen=True)
class Layout:
    """The microbatch shape torch's stages are built for: rows per microbatch, the sequence length
    (decoder LMs; 0 otherwise), and a fingerprint of the inputs' other dimensions."""

    rows: int
    length: int
    tail: int

    def grown(self, other: "Layout") -> "Layout":
        """The layout that holds both (a batch no larger than this one runs in this one)."""
        return Layout(max(self.rows, other.rows), max(self.length, other.length), other.tail)


def refused_padding(attention_mask: torch.Tensor, labels: torch.Tensor, decoder: bool) -> Optional[str]:
    """Why an ``attention_mask`` cannot be honoured without passing it between stages, or None.

    A decoder LM's right-padded batch needs no mask: real tokens attend only to earlier tokens, all
    real, and the outputs at padding positions count only through labels that must be ``-100``."""
    mask = attention_mask.bool()
    if bool(mask.all()):
        return None
    if not decoder:
        return ("pipeline parallelism does not pass an attention_mask between stages: a mask with zeros is understood "
                "only for a transformers decoder LM (right padding); pack the samples without padding or use pp_size=1")
    if mask.shape != labels.shape:
        return (f"the attention_mask of shape {list(mask.shape)} does not match the labels of shape "
                f"{list(labels.shape)}; give both for the same tokens")
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        return ("pipeline parallelism takes right-padded batches only (every row: its tokens, then padding): this "
                "attention_mask has padding before a token (left padding, or holes), which would need the mask on "
                "every stage; pad on the right (tokenizer.padding_side = 'right') or pack the sequences")
    scored = labels[:, 1:][~mask[:, :-1]]
    if bool((scored != IGNORE).any()):
        return (f"{int((scored != IGNORE).sum())} label(s) of this batch are predicted from padding positions (a "
                "position whose attention_mask is 0 predicts the next label); under pipeline parallelism the padding "
                "is not masked, so these labels must be -100 (DataCollatorForLanguageModeling sets -100 on padding)")
    return None


def wanted(samples: int, microbatches: int, labels: torch.Tensor, inputs: Optional[torch.Tensor],
           decoder: bool) -> Layout:
    """The layout this batch needs, before agreement."""
    length = labels.shape[1] if decoder else 0
    tail = -1
    if inputs is not None:
        dims = tuple(inputs.shape[2:] if decoder else inputs.shape[1:])
        tail = zlib.crc32(repr((str(inputs.dtype), dims)).encode())  # not hash(): str hashes differ per process
    return Layout(math.ceil(samples / microbatches), length, tail)


def agree(mine: Layout, refused: bool, device: torch.device) -> tuple[Layout, bool]:
    """The layout every process of the job needs (the largest rows and length), and whether any
    process refused its batch. ValueError when the processes' inputs differ in other dimensions."""
    low = _ABSENT if mine.tail < 0 else -mine.tail
    vec = torch.tensor([mine.rows, mine.length, mine.tail, low, int(refused)], dtype=torch.int64, device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    rows, length, high, low, refused_anywhere = vec.tolist()
    if high >= 0 and high != -low:
        raise ValueError("pipeline parallelism: the processes were given inputs that differ in shape beyond the batch "
                         "dimension (and the sequence length of a decoder LM) at the same step; every process must "
                         "get batches of the same feature shape")
    return Layout(rows, length, high), bool(refused_anywhere)


def completed(inputs: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """The first stage's inputs completed to ``rows`` rows with copies of their own rows and, for a
    decoder LM (``length``), on the right with token 0 up to ``length`` tokens."""
    if length and inputs.shape[1] < length:
        inputs = nn.functional.pad(inputs, (0, length - inputs.shape[1]), value=0)
    return inputs if inputs.shape[0] == rows else _rows(inputs, rows)


def _rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` followed by copies of its rows, cyclically, up to ``rows`` rows."""
    index = torch.arange(rows, device=tensor.device) % tensor.shape[0]
    return tensor.index_select(0, index)


def padded_labels(labels: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """Decoder LM labels completed with ``-100`` (rows and columns): padding counts in no loss."""
    out = torch.full((rows, max(length, labels.shape[1])), IGNORE, dtype=labels.dtype, device=labels.device)
    out[:labels.shape[0], :labels.shape[1]] = labels
    return out
