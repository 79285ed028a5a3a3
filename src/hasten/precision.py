"""Mixed precision: which dtype autocast uses, and the gradient scaler fp16 needs.

One object per Accelerator. It validates the request against the hardware up front (a precision
the device cannot do is an error, never a silent fallback) and owns the unscale-once-per-step
bookkeeping that clipping relies on.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from types import MethodType
from typing import Any, Iterator, Optional

import torch

from .utils.dataclasses import AutocastKwargs, GradScalerKwargs

# fp8 runs the layers it does not convert (and the float8 matmuls' outputs) in bf16, as Accelerate.
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def check_precision_supported(mode: str, device: torch.device) -> None:
    """Raise if ``device`` cannot run ``mode``; the message says what to use instead."""
    # fp8's own requirements are checked by hasten.fp8; around the float8 layers it needs bf16.
    if mode in ("bf16", "fp8"):
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"mixed_precision='bf16' is not supported by {name} (needs compute capability 8.0+); "
                "use mixed_precision='fp16' or 'no'"
            )
        if device.type == "mps" and not torch.backends.mps.is_macos_or_newer(14, 0):
            raise ValueError("mixed_precision='bf16' on MPS needs macOS 14 or newer; use 'fp16' or 'no'")
    if mode == "fp16" and device.type not in ("cuda", "cpu", "xpu", "mps", "npu", "hpu", "mlu", "musa"):
        raise ValueError(f"mixed_precision='fp16' is not supported on device {device}; use 'bf16' or 'no'")


class Precision:
    """Autocast settings and (for fp16) a ``torch.amp.GradScaler``.

    Args:
        mode: "no", "fp16", "bf16" or "fp8".
        device: the device the model runs on.
        scaler_kwargs: arguments for the gradient scaler (fp16 only).
        autocast_kwargs: default arguments of ``autocast()``.
    """

    def __init__(
        self,
        mode: str,
        device: torch.device,
        scaler_kwargs: Optional[GradScalerKwargs] = None,
        autocast_kwargs: Optional[AutocastKwargs] = None,
    ) -> None:
        check_precision_supported(mode, device)
        self.mode = mode
        self.device = device
        self.dtype: Optional[torch.dtype] = _DTYPES.get(mode)
        self.autocast_kwargs = autocast_kwargs or AutocastKwargs()
        self.scaler: Optional[torch.amp.GradScaler] = None
        if mode == "fp16":
            # Accelerate ignores fp16 on CPU; we scale there too, so overflow handling is the same
            # on every device.
            kw = (scaler_kwargs or GradScalerKwargs()).to_dict()
            self.scaler = torch.amp.GradScaler(device.type, **kw)
        # Optimizers already unscaled this step; weak, so a freed optimizer's id reused by a new one never counts.
        self._unscaled: weakref.WeakSet = weakref.WeakSet()

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def autocast(self, autocast_handler: Optional[AutocastKwargs] = None) -> contextlib.AbstractContextManager:
        """Context in which eligible ops run in the low-precision dtype (no-op without mixed precision)."""
        handler = autocast_handler or self.autocast_kwargs
        if not self.enabled or not handler.enabled:
            return contextlib.nullcontext()
        kw: dict[str, Any] = {"dtype": self.dtype}
        if handler.cache_enabled is not None:
            kw["cache_enabled"] = handler.cache_enabled
        return torch.autocast(device_type=self.device.type, **kw)

    def wrap_forward(self, model: torch.nn.Module) -> None:
        """Make ``model.forward`` run under autocast and return fp32 outputs (idempotent)."""
        if not self.enabled or hasattr(model, "_hasten_original_forward"):
            return
        from .utils.operations import convert_outputs_to_fp32

        original = model.forward
        inner = original.__func__ if isinstance(original, MethodType) else original
        autocast = self.autocast

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with autocast():
                return inner(*args, **kwargs)

        forward = convert_outputs_to_fp32(forward)
        model._hasten_original_forward = original
        model.forward = MethodType(forward, model) if isinstance(original, MethodType) else forward

    @staticmethod
    def unwrap_forward(model: torch.nn.Module) -> None:
        original = model.__dict__.pop("_hasten_original_forward", None)
        if original is not None:
            if isinstance(original, MethodType) and original.__self__ is model:
                model.__dict__.pop("forward", None)  # fall back to the class's forward
            else:
                model.forward = original

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_unscaled"] = None  # a WeakSet does not pickle; the unscale record is per step anyway
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._unscaled = weakref.WeakSet()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients of ``optimizer`` once per step; later calls are no-ops."""
        if self.scaler is None or optimizer in self._unscaled:
            return
        self.scaler.unscale_(optimizer)
        self._unscaled.add(optimizer)

    def gradient_scale(self) -> float:
        """The factor the gradients carry now: the loss scale, or 1.0 (no scaler, or unscaled this step)."""
        if self.scaler is None or self._unscaled or not self.scaler.is_enabled():
            return 1.0
        return float(self.scaler.get_scale())

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        """Step ``optimizer`` through the scaler; returns True if the step was skipped (inf/NaN).

        The verdict is the scaler's own: the inf/NaN checks it recorded for this optimizer. Whether
        ``optimizer.step`` ran says nothing for optimizers that unscale inside ``step`` (fused
        AdamW, ``_step_supports_amp_scaling``): they are always called and skip internally.
        """
        if self.scaler is None:
            optimizer.step(closure) if closure is not None else optimizer.step()
            return False
        scale = self.scaler._scale.clone() if self.scaler._scale is not None else None  # no device sync
        self.scaler.step(optimizer, closure) if closure is not None else self.scaler.step(optimizer)
        checks = self.scaler._per_optimizer_states.get(id(optimizer), {}).get("found_inf_per_device")
        self.scaler.update()
        self._unscaled.discard(optimizer)
        if checks:
            return bool(sum(float(found.item()) for found in checks.values()))
        # An optimizer that ran the checks itself (the older grad_scaler= contract) left none here;
        # the scaler then backed off exactly when it found inf/NaN.
        return scale is not None and self.scaler.get_scale() < float(scale)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Leave any surrounding autocast region (e.g. for a loss that must run in fp32)."""
    with torch.autocast(device_type="cpu", enabled=False), torch.autocast(device_type="cuda", enabled=False):
        yield
