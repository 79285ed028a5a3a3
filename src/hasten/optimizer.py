"""The prepared optimizer: steps and zeroes only on gradient-sync steps, reports fp16 skips."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from . import progress
from .precision import Precision
from .state import GradientState, PartialState


def _move_state_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move optimizer state (e.g. Adam moments loaded on CPU) next to the parameters."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device and key != "step":
                state[key] = value.to(device)


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer`` for gradient accumulation and mixed precision.

    ``step()`` and ``zero_grad()`` do nothing on micro-steps that accumulate gradients (inside
    ``accelerator.accumulate`` before the sync step), so the training loop stays unchanged. With
    fp16, ``step()`` goes through the gradient scaler and ``step_was_skipped`` tells whether the
    update was dropped because of inf/NaN gradients.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device_placement: bool = True,
                 precision: Optional[Precision] = None) -> None:
        # No super().__init__: every attribute the base class would set lives on the inner optimizer.
        self.optimizer = optimizer
        self.precision = precision
        self.gradient_state = GradientState()
        self.device_placement = device_placement
        # A bool, or the scaler's 0-d inf/NaN flag (nonzero: skipped), read only when asked: reading
        # it is a host sync that a fused optimizer's scaler step does not otherwise need.
        self._step_was_skipped: Union[bool, torch.Tensor] = False
        if precision is not None and precision.scaler is not None:
            precision.track(optimizer)
        if device_placement:
            _move_state_to(optimizer, PartialState().device)

    # The inner optimizer's attributes, so schedulers and user code see the real thing.
    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        if self.device_placement:
            _move_state_to(self.optimizer, PartialState().device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], float]] = None) -> None:
        if not self.gradient_state.sync_gradients:
            self._step_was_skipped = False
            return
        if self.precision is None or self.precision.scaler is None:
            self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self._step_was_skipped = False
        else:
            self._step_was_skipped = self.precision.optimizer_step(self.optimizer, closure)
        progress.stepped()

    def train(self) -> None:
        """For optimizers with train/eval modes (e.g. schedule-free ones)."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last sync step was skipped because fp16 gradients overflowed (reads the device flag)."""
        return bool(self._step_was_skipped)

    @property
    def skip_flag(self) -> Union[bool, torch.Tensor]:
        """``step_was_skipped`` without reading the device: a bool, or fp16's 0-d inf/NaN flag
        (nonzero: skipped), so a reader of several optimizers can combine them and read once."""
        return self._step_was_skipped

    @property
    def is_overflow(self) -> bool:  # Accelerate's older name
        return self.step_was_skipped

    # Accelerate's private flag behind step_was_skipped; code written for Accelerate sets it to fake an
    # overflow (its scheduler tests do), so setting it sets the skip flag the scheduler reads.
    @property
    def _is_overflow(self) -> bool:
        return self.step_was_skipped

    @_is_overflow.setter
    def _is_overflow(self, value: bool) -> None:
        self._step_was_skipped = bool(value)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def optimizers_owning(optimizers: list[AcceleratedOptimizer], parameters: list) -> list[AcceleratedOptimizer]:
    """The optimizers updating any of ``parameters`` (all of them when none does): the ones a clip
    unscales, as torch's ``scaler.unscale_(optimizer)`` before a clip names its optimizer. Another
    optimizer's gradients (a GAN's generator while its discriminator is clipped) keep the loss scale
    of their iteration until their own step."""
    wanted = set(parameters)  # tensors hash by identity
    owners = [opt for opt in optimizers if any(p in wanted for g in opt.param_groups for p in g["params"])]
    return owners or list(optimizers)


def lomo_backward(optimizers: list[AcceleratedOptimizer], loss: torch.Tensor, learning_rate: Optional[float]) -> None:
    """Backward and update in one pass with LOMO optimizers (``lomo_optim.Lomo``/``AdaLomo``), as
    ``Accelerator.lomo_backward``: each prepared LOMO optimizer runs its ``fused_backward``.

    LOMO updates every parameter as soon as its gradient exists, so there is no separate
    ``optimizer.step()`` and no gradient accumulation: the rate is given with the loss.
    """
    if learning_rate is None:
        raise ValueError("lomo_backward: learning_rate is None; pass the rate of this step, e.g. "
                         "accelerator.lomo_backward(loss, scheduler.get_last_lr()[0])")
    try:
        from lomo_optim import AdaLomo, Lomo
    except ImportError:
        raise ImportError("lomo_backward needs the LOMO optimizers, which are not installed: pip install lomo-optim, "
                          "and prepare a lomo_optim.Lomo or AdaLomo optimizer") from None
    lomo = [o.optimizer for o in optimizers if isinstance(o.optimizer, (Lomo, AdaLomo))]
    if not lomo:
        raise ValueError(f"lomo_backward: none of the prepared optimizers "
                         f"({[type(o.optimizer).__name__ for o in optimizers]}) is a lomo_optim Lomo or AdaLomo; "
                         "prepare one, or use accelerator.backward(loss) and optimizer.step()")
    for optimizer in lomo:
        optimizer.fused_backward(loss, learning_rate)
