"""Mixed precision: which dtype autocast uses, and the gradient scaler fp16 needs.

One object per Accelerator. It validates the request against the hardware up front (a precision
the device cannot do is an error, never a silent fallback) and owns the unscale-once-per-step
bookkeeping that clipping relies on.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator, Optional, Union

import torch

from .utils.dataclasses import AutocastKwargs, GradScalerKwargs
from .utils.versions import dynamo_traces_autocast_hooks

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
        # torch's rule for several optimizers: one ``scaler.update()`` per iteration, after every
        # optimizer stepped. ``_stepped`` holds those stepped since the last update, ``_round``
        # those stepped since every prepared one (``_tracked``) last did; the update runs when the
        # round completes. Backward and step interleaved per optimizer (a GAN: D's backward and
        # step, then G's) is one iteration, so a loss scaled after another optimizer's step keeps
        # the iteration's scale. An optimizer stepping (or unscaling) again before the round
        # completed shows that an iteration ended without the others (one stepped every few
        # iterations): the update that iteration owed runs then, and the gradients in hand, scaled
        # before it, are brought to the new scale (``_late_update``).
        self._stepped: weakref.WeakSet = weakref.WeakSet()
        self._round: weakref.WeakSet = weakref.WeakSet()
        self._tracked: weakref.WeakSet = weakref.WeakSet()

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
        """Make calls of ``model`` run under autocast and return fp32 outputs (idempotent).

        Done with forward hooks (see ``AutocastRegion``), so ``model.forward``, the state-dict
        keys and the module's type stay the user's own.
        """
        if self.enabled and AutocastRegion.of(model) is None:
            AutocastRegion(self._region_settings()).attach(model)

    @staticmethod
    def wrap_compiled(compiled: torch.nn.Module, model: torch.nn.Module) -> None:
        """Enter ``model``'s autocast around ``compiled`` (its ``torch.compile`` wrapper), outside the traced code.

        Dynamo cannot trace a context entered in one hook and left in another; with this outer
        region active the inner model's hooks step aside while being traced, so the compiled graph
        runs under the autocast entered here (a ``fullgraph=True`` compile keeps a single graph).
        No-op when ``model`` has no autocast region (no mixed precision, or FSDP2's policy).
        """
        inner = AutocastRegion.of(model)
        if inner is not None and AutocastRegion.of(compiled) is None:
            AutocastRegion(inner.settings, outer=True).attach(compiled)

    def _region_settings(self) -> tuple[str, torch.dtype, bool, Optional[bool]]:
        handler = self.autocast_kwargs
        return self.device.type, self.dtype, bool(handler.enabled), handler.cache_enabled

    @staticmethod
    def unwrap_forward(model: torch.nn.Module) -> None:
        """Remove what ``wrap_forward``/``wrap_compiled`` added to ``model`` (no-op if nothing)."""
        region = AutocastRegion.of(model)
        if region is not None:
            region.detach()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # WeakSets do not pickle; the unscale and step records are per iteration anyway.
        state["_unscaled"] = state["_stepped"] = state["_round"] = state["_tracked"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._unscaled = weakref.WeakSet()
        self._stepped = weakref.WeakSet()
        self._round = weakref.WeakSet()
        self._tracked = weakref.WeakSet()

    def track(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer`` among those that step once per iteration (see ``optimizer_step``)."""
        self._tracked.add(optimizer)

    def _update(self) -> None:
        """End the iteration: the scaler's one update, and a fresh unscale record for every optimizer."""
        self.scaler.update()
        self._stepped.clear()
        self._unscaled.clear()

    def _late_update(self) -> None:
        """The update of an iteration that ended before every optimizer stepped, found out when one
        steps again: the gradients now held were scaled with the scale before this update, so they
        are multiplied by new/old (a power of two with the default factors: exact), as if their
        loss had been scaled after it, as in a loop calling ``update()`` at each iteration's end."""
        old = self.scaler._scale.clone() if self.scaler._scale is not None else None
        self._update()
        if old is None or self.scaler._scale is None:
            return
        grads = [p.grad for opt in self._tracked for g in opt.param_groups for p in g["params"] if p.grad is not None]
        ratio = float(self.scaler._scale / old)  # a host read, on this rare path only (DTensor grads take a float)
        if ratio != 1.0:
            for grad in grads:
                grad.mul_(ratio)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            return loss
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients of ``optimizer`` once per step; later calls are no-ops."""
        if self.scaler is None:
            return
        if optimizer in self._stepped:  # stepped since the last update: a new iteration's gradients
            self._late_update()
        if optimizer in self._unscaled:
            return
        if not any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
            # Nothing to unscale yet (every optimizer unscaled before one's clip, say a GAN's G before
            # its backward): its step unscales what it gets then; torch's scaler would record no
            # check now and refuse that step.
            return
        self.scaler.unscale_(optimizer)
        self._unscaled.add(optimizer)

    def gradient_scale(self) -> float:
        """The factor the gradients carry now: the loss scale, or 1.0 (no scaler, or unscaled this step)."""
        if self.scaler is None or self._unscaled or not self.scaler.is_enabled():
            return 1.0
        return float(self.scaler.get_scale())

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Union[bool, torch.Tensor]:
        """Step ``optimizer`` through the scaler; returns whether the step was skipped (inf/NaN).

        The verdict is the scaler's own: the inf/NaN checks it recorded for this optimizer. Whether
        ``optimizer.step`` ran says nothing for optimizers that unscale inside ``step`` (fused
        AdamW, ``_step_supports_amp_scaling``): they are always called and skip internally. The
        verdict is returned as a 0-d tensor (nonzero: skipped), not read here: reading it is a host
        sync, which torch's scaler path for those optimizers does not have.

        ``scaler.update()`` runs once per iteration (torch's rule): when every prepared optimizer
        has stepped, else when one steps again (``_late_update``). Updating after each optimizer
        would forget the others' unscale (a second unscale later) and grow the scale once per optimizer.
        """
        if self.scaler is None:
            optimizer.step(closure) if closure is not None else optimizer.step()
            return False
        if optimizer in self._stepped:  # stepped again before the others: a new iteration
            self._late_update()
        self.scaler.step(optimizer, closure) if closure is not None else self.scaler.step(optimizer)
        checks = self.scaler._per_optimizer_states.get(id(optimizer), {}).get("found_inf_per_device")
        self._stepped.add(optimizer)
        self._round.add(optimizer)
        if checks:
            verdict: Union[bool, torch.Tensor] = _found_any(list(checks.values()))
            if all(opt in self._round for opt in self._tracked):
                self._round.clear()
                self._update()
            return verdict
        # An optimizer that ran the checks itself (the older grad_scaler= contract) left none here;
        # the scaler then backs off exactly when it found inf/NaN, so its update is needed now.
        self._round.clear()
        scale = self.scaler._scale.clone() if self.scaler._scale is not None else None  # no device sync
        self._update()
        return scale is not None and self.scaler._scale is not None and self.scaler._scale < scale

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as the next loss will see it: an update still due is applied (to a
        copy, since other optimizers may still step this iteration), so a resumed run loses none."""
        if self.scaler is None:
            return {}
        if not len(self._stepped):
            return self.scaler.state_dict()
        return _settled_state(self.scaler)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def _settled_state(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    """``scaler.state_dict()`` after the ``update()`` that is due, computed on copies (the scaler
    itself cannot update yet, nor be copied mid-iteration); the same kernel ``update()`` runs."""
    state = scaler.state_dict()
    if not state or scaler._scale is None or scaler._growth_tracker is None:
        return state
    found = [flag for opt in scaler._per_optimizer_states.values() for flag in opt["found_inf_per_device"].values()]
    if not found:
        return state
    scale, tracker = scaler._scale.clone(), scaler._growth_tracker.clone()
    torch._amp_update_scale_(scale, tracker, _found_any(found).to(scale.device), state["growth_factor"],
                             state["backoff_factor"], state["growth_interval"])
    state["scale"], state["_growth_tracker"] = scale.item(), int(tracker.item())
    return state


def _found_any(found: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the per-device inf/NaN flags, on the first one's device, without a host sync."""
    total = found[0].clone()
    for flag in found[1:]:
        total += flag.to(total.device, non_blocking=True)
    return total


class _OuterRegions:
    """How many outer (compile-wrapper) regions are active in this process. Read by traced code,
    so a plain class attribute (not thread-local): dynamo guards on its value."""

    depth = 0


class _Entered(threading.local):
    """Per thread: the autocast contexts that regions entered and have not left yet (innermost last)."""

    def __init__(self) -> None:
        self.stack: list[tuple["AutocastRegion", contextlib.AbstractContextManager]] = []


_ENTERED = _Entered()


class AutocastRegion:
    """Forward hooks that run a module under ``torch.autocast`` and hand back fp32 outputs.

    A forward pre-hook enters the autocast; a forward hook registered with ``always_call`` (it
    runs when forward raises too) leaves it and converts fp16/bf16 outputs to fp32. Hooks rather
    than a replaced ``forward``: the module keeps its own method, type and state-dict keys, and the
    region pickles with it (the hooks are bound methods of this object).

    Under ``torch.compile`` the hooks work either way dynamo meets them, so a model the user
    compiles with ``fullgraph=True`` stays one graph:

    - inlined into a traced frame (a ``torch.nn`` module such as ``Sequential`` compiled whole, or
      a prepared module called inside a compiled one): they are traced into the graph. The
      autocast is entered with ``torch.amp._enter_autocast`` (what ``torch.export`` records for an
      autocast region), whose object dynamo follows from the pre-hook to the forward hook;
    - as frames of their own (``torch.compile`` of a user-defined module runs its hooks outside
      the graph and compiles ``forward``): dynamo skips them, they run eagerly, and ``forward`` is
      traced under the autocast they entered, as under a caller's ``with torch.autocast``.

    When hasten compiles a wrapped model, an *outer* region on the compile wrapper enters the
    autocast eagerly and the inner hooks, while traced, do nothing.

    Args:
        settings: (device type, dtype, autocast enabled, cache_enabled or None).
        outer: True for the region around a compile wrapper.
    """

    def __init__(self, settings: tuple[str, torch.dtype, bool, Optional[bool]], outer: bool = False) -> None:
        self.settings = settings
        self.outer = outer
        self._handles: tuple[Any, ...] = ()

    @staticmethod
    def of(module: torch.nn.Module) -> Optional["AutocastRegion"]:
        """The region attached to ``module``, or None."""
        for hook in module._forward_pre_hooks.values():
            region = getattr(hook, "__self__", None)
            if isinstance(region, AutocastRegion):
                return region
        return None

    def attach(self, module: torch.nn.Module) -> None:
        _make_eager()
        self._handles = (module.register_forward_pre_hook(self.before),
                         module.register_forward_hook(self.after, always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = ()

    def __setstate__(self, state: dict[str, Any]) -> None:  # unpickled in a new process: hooks can run there
        self.__dict__.update(state)
        _make_eager()

    def _steps_aside(self) -> bool:
        # Traced inside hasten's compile wrapper: the autocast entered by its region is in force.
        return not self.outer and _OuterRegions.depth > 0 and torch.compiler.is_compiling()

    def before(self, module: torch.nn.Module, args: Any) -> None:
        if self._steps_aside():
            return
        if torch.compiler.is_compiling() and _TRACEABLE:  # inlined into a traced frame: into its graph
            _enter(self)
        else:
            _EAGER["enter"](self)

    def after(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self._steps_aside():
            return None
        if torch.compiler.is_compiling() and _TRACEABLE:
            return _leave(self, output)
        return _EAGER["leave"](self, output)


def _enter(region: AutocastRegion) -> None:
    # ``torch.amp._enter_autocast``/``_exit_autocast`` rather than ``autocast().__enter__()``: the
    # same autocast object and state changes, but dynamo traces them (it refuses a bare
    # ``__enter__`` call), so an inlined region is part of the caller's graph.
    device_type, dtype, enabled, cache_enabled = region.settings
    context = torch.amp._enter_autocast(device_type, dtype, True, cache_enabled) if enabled else None
    _ENTERED.stack.append((region, context))
    if region.outer:
        _OuterRegions.depth += 1


def _leave(region: AutocastRegion, output: Any) -> Any:
    """Leave what ``region`` entered and return ``output`` with fp16/bf16 tensors made fp32."""
    from .utils.operations import convert_to_fp32

    # Only what this region entered: if an earlier pre-hook raised, ours never ran.
    if _ENTERED.stack and _ENTERED.stack[-1][0] is region:
        _, context = _ENTERED.stack.pop()
        if region.outer:
            _OuterRegions.depth -= 1
        if context is not None:  # None: AutocastKwargs(enabled=False), the caller's autocast stays as it is
            torch.amp._exit_autocast(context)
    return convert_to_fp32(output)


# _enter and _leave as the hooks run them outside traced code, with dynamo kept out (a compiled
# frame must not change the autocast state for the frames after it). Made when a region is
# attached or unpickled, not at import: torch.compiler.disable imports dynamo (about a second).
_EAGER: dict[str, Callable[..., Any]] = {}
_TRACEABLE = dynamo_traces_autocast_hooks()


def _make_eager() -> None:
    if _EAGER:
        return
    from torch._dynamo.eval_frame import skip_code

    # The hooks as frames of their own (torch.compile of a user-defined module calls them from
    # the untraced ``Module.__call__``) are run by Python, not compiled; inlined, they are traced.
    skip_code(AutocastRegion.before.__code__)
    skip_code(AutocastRegion.after.__code__)
    _EAGER.update(enter=torch.compiler.disable(_enter), leave=torch.compiler.disable(_leave))


# Device types that can hold an autocast state (privateuse1 backends are added at call time).
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla")


def _autocasting_device_types() -> list[str]:
    found = []
    for device_type in dict.fromkeys((*_AUTOCAST_DEVICE_TYPES, torch._C._get_privateuse1_backend_name())):
        try:
            if torch.is_autocast_enabled(device_type):
                found.append(device_type)
        except (RuntimeError, TypeError):  # a device type this torch build does not know
            continue
    return found


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Leave any surrounding autocast region (e.g. for a loss that must run in fp32).

    Only the device types whose autocast is on are touched: an MPS or XPU autocast is left too,
    and no autocast is created for a device this host does not have.
    """
    with contextlib.ExitStack() as stack:
        for device_type in _autocasting_device_types():
            stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        yield
