"""Describing nested tensors without their data, and rebuilding empty ones from the description
(Accelerate's ``TensorInformation`` helpers, used to send a batch's layout ahead of the batch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .operations import recursively_apply


@dataclass
class TensorInformation:
    """The shape and dtype of one tensor."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(tensor_info: Any) -> bool:
    return isinstance(tensor_info, TensorInformation)


def get_data_structure(data: Any) -> Any:
    """``data`` (nested lists/tuples/dicts of tensors) with a ``TensorInformation`` in place of each tensor."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """The structure ``get_data_structure`` returned, with an uninitialised CPU tensor for each description."""
    return recursively_apply(lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure,
                             test_type=is_tensor_information)


def _padded_length(batch_size: int, num_processes: int) -> int:
    # Accelerate's rule, kept so that the same batch pads to the same length under either library.
    per_process = batch_size // num_processes
    left_over = batch_size - per_process * num_processes
    to_pad = num_processes - batch_size if per_process == 0 else num_processes - per_process
    if left_over > to_pad and to_pad < 1:
        to_pad = left_over - to_pad
    return batch_size + to_pad


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Each tensor of ``tensor`` (nested) zero-padded along dimension 0 so that a batch of ``batch_size``
    can be split over ``num_processes`` (the inference helpers split a prompt batch this way)."""

    def pad(t: torch.Tensor, batch_size: int, num_processes: int, dim: int = 0) -> torch.Tensor:
        shape = list(t.shape)
        shape[0] = _padded_length(batch_size, num_processes)
        out = t.new_zeros(shape)
        out[tuple(slice(0, t.shape[dim]) if i == dim else slice(None) for i in range(len(shape)))] = t
        return out

    return recursively_apply(pad, tensor, error_on_other_type=True, batch_size=batch_size,
                             num_processes=num_processes, dim=dim)
