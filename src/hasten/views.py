"""The ``Accelerator``'s read-only views of its settings (Accelerate's property names).

Kept apart so the facade's module is about wiring and the training step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .options import accumulation_plugin
from .utils.fp8_recipes import FP8BackendType


class SettingsViewsMixin:
    """Properties read from the state, the precision, the dataloader and project configurations."""

    state: Any
    precision: Any
    fp8: Any
    gradient_state: Any
    dataloader_config: Any
    project_configuration: Any
    _prepared: Any  # prepared.PreparedObjects

    # What prepare() handed out, in order (read-only views of the registry; the Accelerator writes it).
    @property
    def _models(self) -> list:
        return self._prepared.models

    @property
    def _optimizers(self) -> list:
        return self._prepared.optimizers

    @property
    def _schedulers(self) -> list:
        return self._prepared.schedulers

    @property
    def _dataloaders(self) -> list:
        return self._prepared.dataloaders

    @property
    def _custom_objects(self) -> list:
        return self._prepared.custom_objects

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def distributed_type(self):
        return self.state.distributed_type

    @property
    def mixed_precision(self) -> str:
        return self.state.mixed_precision

    @property
    def scaler(self) -> Optional[torch.amp.GradScaler]:
        return self.precision.scaler

    @property
    def fp8_enabled(self) -> bool:
        return self.fp8 is not None

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The library running fp8 (``FP8BackendType.NO`` without fp8)."""
        return self.fp8.backend if self.fp8 is not None else FP8BackendType.NO

    @property
    def native_amp(self) -> bool:
        return self.precision.enabled

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state._set_sync_gradients(value)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.plugin_kwargs["num_steps"] = accumulation_plugin(steps, None).num_steps

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 gradients overflowed)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> Optional[bool]:
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def project_dir(self) -> Optional[str]:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> Optional[str]:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration
