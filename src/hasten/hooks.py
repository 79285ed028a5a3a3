"""Accelerate's module hooks: code run around a module's forward that sees (and may change) its
positional *and keyword* arguments, e.g. to load offloaded weights just before the forward.

Why this wraps ``forward`` (the rest of hasten never replaces methods): this is a public API whose
contract other libraries rely on. transformers, diffusers and PEFT look for ``module._hf_hook``,
call ``module._old_forward`` and expect a hook to run when ``module.forward(...)`` is called
directly, not only through ``module(...)``; torch's own forward hooks do neither. So
``add_hook_to_module`` sets ``module._hf_hook`` and ``module._old_forward`` and puts a wrapper in
the instance's ``forward``; ``remove_hook_from_module`` undoes exactly that, after which the module
is the plain module again (its class's ``forward`` shows through). The wrapper and
``_old_forward`` hold the module weakly, so a hooked model is freed by reference counting as soon
as the last reference goes, not at the next garbage-collector pass. ``inspect.signature`` of the
wrapped forward is the original one (transformers inspects it to route ``generate`` arguments).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
from torch import nn

from .utils.modeling import (_get_tensor, named_module_tensors, non_persistent_buffers, put_tensor,
                             set_module_tensor_to_device)
from .utils.offload import PrefixedDataset
from .utils.operations import find_device, send_to_device

DeviceLike = Union[int, str, torch.device]


class ModelHook:
    """Callbacks around a module's forward; unlike torch's hooks they receive the keyword arguments.

    ``no_grad = True`` runs the wrapped forward under ``torch.no_grad()``.
    """

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is attached; returns the module."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Called before the forward; returns the (possibly changed) ``args`` and ``kwargs``."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after the forward; returns the (possibly changed) output."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed; returns the module."""
        return module


class SequentialHook(ModelHook):
    """Several hooks run in order (``post_forward`` in the same order as ``pre_forward``)."""

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _dead() -> ReferenceError:
    return ReferenceError("this forward belongs to a module that no longer exists")


class _WeakBound:
    """A method bound to its module through a weak reference (``module._old_forward``)."""

    __slots__ = ("_function", "_module", "__weakref__")

    def __init__(self, function: Callable, module: nn.Module) -> None:
        self._function, self._module = function, weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            raise _dead()
        return self._function(module, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "_WeakBound":  # a copied module gets its own binding
        return type(self)(self._function, copy.deepcopy(self._module(), memo))

    @property
    def __signature__(self) -> inspect.Signature:
        module = self._module()
        if module is None:
            raise _dead()
        return inspect.signature(self._function.__get__(module))

    @property
    def __name__(self) -> str:
        return getattr(self._function, "__name__", "forward")


def _original_forward(module: nn.Module) -> Callable:
    """The module's forward as ``_old_forward`` stores it: weakly bound when it is a method of the module."""
    forward = module.forward
    if inspect.ismethod(forward) and forward.__self__ is module:
        return _WeakBound(forward.__func__, module)
    return forward  # a forward someone else put on the instance: keep it as it is


class _HookedForward:
    """What ``module.forward`` is while a hook is attached: the hook around ``module._old_forward``."""

    __slots__ = ("_module", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            raise _dead()
        hook = module._hf_hook
        args, kwargs = hook.pre_forward(module, *args, **kwargs)
        if hook.no_grad:
            with torch.no_grad():
                output = module._old_forward(*args, **kwargs)
        else:
            output = module._old_forward(*args, **kwargs)
        return hook.post_forward(module, output)

    def __deepcopy__(self, memo: dict) -> "_HookedForward":  # a copied module gets its own wrapper
        return type(self)(copy.deepcopy(self._module(), memo))

    @property
    def __signature__(self) -> inspect.Signature:
        module = self._module()
        if module is None:
            raise _dead()
        return inspect.signature(module._old_forward)

    @property
    def __name__(self) -> str:
        module = self._module()
        return getattr(module._old_forward, "__name__", "forward") if module is not None else "forward"


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module`` (in place; the module is returned).

    A hook already there is replaced (without its ``detach_hook``, as in Accelerate), unless ``append=True``: then both run, the old one first,
    as one ``SequentialHook``. ``module._hf_hook`` is the attached hook.
    """
    if not isinstance(hook, ModelHook):
        raise TypeError(f"add_hook_to_module needs a ModelHook, got a {type(hook).__name__}")
    if "GraphModuleImpl" in type(module).__name__:
        raise NotImplementedError("add_hook_to_module: torch.fx GraphModule instances are not supported by hasten's "
                                  "hooks; hook the module before tracing it")
    previous = getattr(module, "_hf_hook", None)
    if append and previous is not None:
        remove_hook_from_module(module)
        hook = SequentialHook(previous, hook)
    if "_old_forward" not in module.__dict__:
        module._old_forward = _original_forward(module)
    module = hook.init_hook(module)
    module._hf_hook = hook
    module.forward = _HookedForward(module)
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` (and of all its submodules with ``recurse``); the original forward returns."""
    hook = module.__dict__.get("_hf_hook")
    if hook is not None:
        hook.detach_hook(module)
        del module._hf_hook
    old = module.__dict__.pop("_old_forward", None)
    if old is not None:
        module.__dict__.pop("forward", None)
        if not isinstance(old, _WeakBound):  # the instance had its own forward before: put it back
            module.forward = old
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Detach the hooks of ``module`` and of every submodule."""
    remove_hook_from_module(module, recurse=True)


class AlignDevicesHook(ModelHook):
    """Runs a module on ``execution_device``: moves its inputs (and, for offloaded modules, its weights) there.

    execution_device: where the forward runs (weights are moved there at attach time unless
    ``offload``). offload: the module's weights live in ``weights_map`` (a dict or an
    ``OffloadedWeightsLoader``) and on ``meta`` in the module; each forward loads them on the
    execution device and drops them after. io_same_device: the output goes back to the device of
    the input. offload_buffers: buffers are offloaded too (else they stay on the execution
    device). place_submodules: handle the tensors of all submodules, not only the module's own.
    skip_keys: keyword arguments left where they are. tied_params_map: ``{data_ptr: {device:
    tensor}}`` shared by all hooks of a model, so that tied weights are loaded once per device.
    """

    def __init__(self, execution_device: Optional[DeviceLike] = None, offload: bool = False,
                 io_same_device: bool = False, weights_map: Optional[Mapping] = None, offload_buffers: bool = False,
                 place_submodules: bool = False, skip_keys: Union[str, list[str], None] = None,
                 tied_params_map: Optional[dict[int, dict[Any, torch.Tensor]]] = None) -> None:
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.input_device: Optional[torch.device] = None
        self.tied_params_map = tied_params_map
        self.original_devices: dict[str, torch.device] = {}
        self._loaded_ties: list[tuple[int, Any]] = []
        self._stand_ins: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
                f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
                f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})")

    def _offloaded(self, module: nn.Module) -> list[str]:
        return [name for name, _ in named_module_tensors(module, include_buffers=self.offload_buffers,
                                                          recurse=self.place_submodules, remove_non_persistent=True)]

    def init_hook(self, module: nn.Module) -> nn.Module:
        if str(self.execution_device) == "meta":
            self.tied_params_map = None  # meta tensors have no data pointers to share
        if not self.offload:
            if self.execution_device is not None:
                for name, _ in named_module_tensors(module, recurse=self.place_submodules):
                    set_module_tensor_to_device(module, name, self.execution_device,
                                                tied_params_map=self.tied_params_map, clear_cache=False)
            return module
        self.original_devices = {name: t.device for name, t in named_module_tensors(module, recurse=self.place_submodules)}
        if self.weights_map is None:  # keep a CPU copy of what is offloaded
            self.weights_map = {name: t.to("cpu") for name, t in
                                named_module_tensors(module, include_buffers=self.offload_buffers,
                                                     recurse=self.place_submodules)}
        for name in self._offloaded(module):
            set_module_tensor_to_device(module, name, "meta", clear_cache=False)
        if self.execution_device is not None:
            kept = (non_persistent_buffers(module, self.place_submodules) if self.offload_buffers
                    else [n for n, _ in module.named_buffers(recurse=self.place_submodules)])
            for name in kept:
                set_module_tensor_to_device(module, name, self.execution_device,
                                            tied_params_map=self.tied_params_map, clear_cache=False)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            names = self._offloaded(module)
            # The meta stand-ins go back after the forward: the same objects, so ties between them hold.
            self._stand_ins = {name: _get_tensor(module, name) for name in names}
            for name in names:
                value = self.weights_map[name]
                if self.tied_params_map is not None and value.device.type != "meta":
                    entry = self.tied_params_map.get(value.data_ptr())
                    if entry is not None and self.execution_device not in entry:
                        self._loaded_ties.append((value.data_ptr(), self.execution_device))
                # No cache clearing per tensor: the allocator reuses what post_forward just freed.
                set_module_tensor_to_device(module, name, self.execution_device, value=value,
                                            tied_params_map=self.tied_params_map, clear_cache=False)
        if self.execution_device is None:
            return args, kwargs
        return (send_to_device(args, self.execution_device),
                send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys))

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            stand_ins = self._stand_ins
            for name in self._offloaded(module):
                meta = stand_ins.get(name)
                if meta is not None and meta.device.type == "meta":
                    put_tensor(module, name, meta)
                else:
                    set_module_tensor_to_device(module, name, "meta", clear_cache=False)
            self._stand_ins = {}
            for pointer, device in self._loaded_ties:  # let the shared copies go
                self.tied_params_map.get(pointer, {}).pop(device, None)
            self._loaded_ties = []
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload:  # give the module its weights back where they were
            for name, device in self.original_devices.items():
                if device.type != "meta" and name in self.weights_map:
                    set_module_tensor_to_device(module, name, device, value=self.weights_map[name], clear_cache=False)
        return module


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether ``module`` itself carries an ``AlignDevicesHook`` that offloads its weights."""
    hook = getattr(module, "_hf_hook", None)
    return isinstance(hook, AlignDevicesHook) and bool(hook.offload)


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device: Optional[DeviceLike] = None) -> Iterator[None]:
    """Inside the block, ``module``'s own weights are real tensors on a device, then go back.

    An offloaded module (``has_offloaded_params``) has its weights loaded as for a forward, on
    ``execution_device`` if given, else on its hook's execution device. Otherwise, with
    ``execution_device``, the module's direct parameters move there and back; without it nothing changes.
    """
    if has_offloaded_params(module):
        hook = module._hf_hook
        saved = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            hook.execution_device = saved
    elif execution_device is not None:
        devices = {name: param.device for name, param in module.named_parameters(recurse=False)}
        try:
            for name in devices:
                set_module_tensor_to_device(module, name, execution_device)
            yield
        finally:
            for name, device in devices.items():
                set_module_tensor_to_device(module, name, device)
    else:
        yield


def attach_execution_device_hook(module: nn.Module, execution_device: DeviceLike,
                                 skip_keys: Union[str, list[str], None] = None,
                                 preload_module_classes: Optional[list[str]] = None,
                                 tied_params_map: Optional[dict] = None) -> None:
    """Give every submodule that holds tensors and has no hook one that moves its inputs to ``execution_device``."""
    if "_hf_hook" not in module.__dict__ and len(module.state_dict()) > 0:
        add_hook_to_module(module, AlignDevicesHook(execution_device, skip_keys=skip_keys,
                                                    tied_params_map=tied_params_map))
    if preload_module_classes is not None and type(module).__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, preload_module_classes, tied_params_map)


def attach_align_device_hook(module: nn.Module, execution_device: Optional[DeviceLike] = None, offload: bool = False,
                             weights_map: Optional[Mapping] = None, offload_buffers: bool = False,
                             module_name: str = "", skip_keys: Union[str, list[str], None] = None,
                             preload_module_classes: Optional[list[str]] = None,
                             tied_params_map: Optional[dict] = None) -> None:
    """Attach an ``AlignDevicesHook`` to every submodule holding tensors of its own (appended to any hook).

    Submodules of a class in ``preload_module_classes`` load all their weights (their submodules'
    too) at the start of their own forward, for modules that use a child's weights without calling it.
    """
    whole = offload and preload_module_classes is not None and type(module).__name__ in preload_module_classes
    if whole or next(named_module_tensors(module), None) is not None:
        prefix = f"{module_name}." if module_name else ""
        hook = AlignDevicesHook(execution_device=execution_device, offload=offload,
                                weights_map=None if weights_map is None else PrefixedDataset(weights_map, prefix),
                                offload_buffers=offload_buffers, place_submodules=whole, skip_keys=skip_keys,
                                tied_params_map=tied_params_map)
        add_hook_to_module(module, hook, append=True)
    if whole:
        return
    for name, child in module.named_children():
        attach_align_device_hook(child, execution_device, offload, weights_map, offload_buffers,
                                 f"{module_name}.{name}" if module_name else name, skip_keys,
                                 preload_module_classes, tied_params_map)


def attach_align_device_hook_on_blocks(module: nn.Module, execution_device: Union[DeviceLike, Mapping, None] = None,
                                       offload: Union[bool, Mapping[str, bool]] = False,
                                       weights_map: Optional[Mapping] = None, offload_buffers: bool = False,
                                       module_name: str = "", skip_keys: Union[str, list[str], None] = None,
                                       preload_module_classes: Optional[list[str]] = None,
                                       tied_params_map: Optional[dict] = None) -> None:
    """Hooks for a model split into blocks: ``execution_device`` / ``offload`` per block name (or one for all).

    A block kept on its device gets one hook that moves its weights there and its inputs; an
    offloaded block gets per-submodule hooks that load weights for each forward. The root gets a
    hook that returns outputs on the input's device.
    """
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if offload:
            attach_align_device_hook(module, execution_device, True, weights_map, offload_buffers, module_name,
                                     skip_keys, tied_params_map=tied_params_map)
        else:
            add_hook_to_module(module, AlignDevicesHook(execution_device, io_same_device=True, skip_keys=skip_keys,
                                                        place_submodules=True, tied_params_map=tied_params_map))
        return
    if not isinstance(execution_device, Mapping):
        execution_device = {key: execution_device for key in offload}
    if not isinstance(offload, Mapping):
        offload = {key: offload for key in execution_device}

    is_root = module_name == ""
    if module_name in execution_device and module_name in offload:
        device = execution_device[module_name]
        if not offload[module_name]:
            add_hook_to_module(module, AlignDevicesHook(device, offload_buffers=offload_buffers, io_same_device=is_root,
                                                        place_submodules=True, skip_keys=skip_keys,
                                                        tied_params_map=tied_params_map))
        else:
            attach_align_device_hook(module, device, True, weights_map, offload_buffers, module_name, skip_keys,
                                     preload_module_classes, tied_params_map)
            if "_hf_hook" not in module.__dict__:
                add_hook_to_module(module, AlignDevicesHook(device, io_same_device=is_root, skip_keys=skip_keys,
                                                            tied_params_map=tied_params_map))
        attach_execution_device_hook(module, device, skip_keys, preload_module_classes, tied_params_map)
        return  # everything below this block is handled
    prefix = f"{module_name}." if module_name else ""
    own = [prefix + n for n, _ in named_module_tensors(module) if prefix + n in execution_device]
    if own or is_root:  # tensors of this module mapped one by one (a split module), or the model's root
        device = execution_device[own[0]] if own else execution_device.get("")
        offloaded = bool(own) and any(offload.get(n, False) for n in own)
        add_hook_to_module(module, AlignDevicesHook(
            device, offload=offloaded, io_same_device=is_root, offload_buffers=offload_buffers, skip_keys=skip_keys,
            weights_map=PrefixedDataset(weights_map, prefix) if offloaded and weights_map is not None else None,
            tied_params_map=tied_params_map))
    for name, child in module.named_children():
        attach_align_device_hook_on_blocks(child, execution_device, offload, weights_map, offload_buffers,
                                           f"{module_name}.{name}" if module_name else name, skip_keys,
                                           preload_module_classes, tied_params_map)


class CpuOffload(ModelHook):
    """Keeps a model on the CPU until its forward, then moves it whole to ``execution_device`` (where it stays
    until ``offload()`` of its ``UserCpuOffloadHook``). ``prev_module_hook``: offloaded before this forward."""

    def __init__(self, execution_device: Optional[DeviceLike] = None,
                 prev_module_hook: Optional["UserCpuOffloadHook"] = None) -> None:
        self.prev_module_hook = prev_module_hook
        if execution_device is None:
            from .state import PartialState

            execution_device = PartialState().default_device
        self.execution_device = execution_device

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        previous = self.prev_module_hook
        if previous is not None:
            first = next(previous.model.parameters(), None)
            if first is not None and first.device.type != "cpu":
                previous.offload()
                from .utils.memory import clear_device_cache

                clear_device_cache()
        first = next(module.parameters(), None)
        target = torch.device(self.execution_device) if not isinstance(self.execution_device, int) \
            else torch.device("cuda", self.execution_device)
        if first is not None and first.device == target:
            return args, kwargs
        module.to(target)
        return send_to_device(args, target), send_to_device(kwargs, target)


class UserCpuOffloadHook:
    """Returned by ``cpu_offload_with_hook``: ``offload()`` moves the model back to the CPU, ``remove()`` detaches."""

    def __init__(self, model: nn.Module, hook: CpuOffload) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)
