"""Process-wide state: who am I, which device, which process group; and the gradient-sync state.

``PartialState`` (topology + device + process group), ``AcceleratorState`` (adds precision and the
parallel strategy's plugins) and ``GradientState`` (sync flags, active dataloader) are singletons
shared by every instance, as in Accelerate: creating one anywhere gives the same view everywhere.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import warnings
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from . import progress
from .device_choice import MULTI_TYPES, choose_backend, fsdp_wanted, own_gpu, pick_device  # noqa: F401 - own_gpu: public here too
from .group_lifetime import round_store, save_group, tear_down_at_exit
from .strategy_rules import distributed_type_for
from .topology import DataParallel, Topology, detect_topology
from .utils.dataclasses import DistributedType, GradientAccumulationPlugin, PrecisionType
from .utils.environment import parse_choice, parse_flag
from .warning_kinds import HastenWarning

class SharedDict:
    """Mixin: every instance of a subclass shares one ``__dict__`` (a process-wide singleton)."""

    _shared_state: dict[str, Any] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._shared_state = {}

    def _bind_shared(self) -> None:
        self.__dict__ = self._shared_state

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled, an instance is this process's singleton again (not a detached copy): the
        # state it carried fills the singleton only where this process has none yet.
        self._bind_shared()
        if not self._shared_state:
            self._shared_state.update(state)

    def _reset_error(self, name: str) -> AttributeError:
        """Reading ``name`` from a state that was reset (``_reset_state()``) after it was created."""
        kind = type(self).__name__
        return AttributeError(
            # Accelerate's wording first: scripts written for it look for it.
            f"`{kind}` object has no attribute `{name}`. This happens if `{kind}._reset_state()` was called "
            f"after this object (or the Accelerator holding it) was created: {kind}.{name} is gone with the "
            f"process state. Create a new Accelerator after the reset and prepare your objects with it"
        )


# What PartialState.__init__ sets: reading one from a reset state gets an explanation.
_PARTIAL_FIELDS = frozenset({"topology", "device", "backend", "distributed_type", "debug", "fork_launched",
                             "owns_group", "group_closed"})


class PartialState(SharedDict):
    """The topology of this process and its device; initialises the process group once.

    Args:
        cpu: run on CPU even if an accelerator is present.
        **kwargs: passed to ``torch.distributed.init_process_group`` (``backend``, ``timeout``,
            ``init_method``) when this process is one of several.
    """

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self._bind_shared()
        if self.initialized:
            return
        # Set by AcceleratorState: the plugin the Accelerator got (FSDP needs a group even on one process).
        fsdp, offload = fsdp_wanted(kwargs.pop("_fsdp_plugin", None))
        cpu = cpu or parse_flag("USE_CPU")
        topo = detect_topology()
        device = pick_device(topo, cpu)
        backend = kwargs.pop("backend", None) or choose_backend(device.type, offload)
        if topo.distributed:
            self._init_process_group(topo, device, backend, kwargs)
        elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The user built the group himself (e.g. spawned processes): adopt it.
            topo = Topology(rank=dist.get_rank(), world_size=dist.get_world_size(),
                            local_rank=dist.get_rank(), local_world_size=dist.get_world_size(),
                            source="existing")
            backend = dist.get_backend()
        self.topology = topo
        self.device = device
        self.backend = backend if topo.distributed else None
        self.owns_group = False  # True once this process made its own one-process group
        self.group_closed = False  # True once end_training/destroy_process_group tore the group down
        if fsdp and not topo.distributed:
            self.open_one_process_group(backend, **kwargs)
        self.distributed_type = MULTI_TYPES.get(device.type, DistributedType.MULTI_CPU) if topo.distributed else DistributedType.NO
        self.debug = parse_flag("DEBUG")
        self.fork_launched = parse_flag("FORK_LAUNCHED")
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def __getattr__(self, name: str) -> Any:  # only reached for attributes that are not set
        if not self.initialized and (name in _PARTIAL_FIELDS or hasattr(type(self), name)):  # a property of ours
            raise self._reset_error(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @staticmethod
    def _init_process_group(topo: Topology, device: torch.device, backend: str, kwargs: dict) -> None:
        if dist.is_initialized():
            return
        if topo.master_addr:
            os.environ.setdefault("MASTER_ADDR", topo.master_addr)
        if topo.master_port:
            os.environ.setdefault("MASTER_PORT", str(topo.master_port))
        _check_timeout(kwargs)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if kwargs.get("init_method") is None and kwargs.get("store") is None:
            store = round_store(kwargs.get("timeout"))
            if store is not None:
                kwargs.pop("init_method", None)
                kwargs["store"] = store
        dist.init_process_group(backend=backend, rank=topo.rank, world_size=topo.world_size, **kwargs)
        atexit.register(tear_down_at_exit, dist.group.WORLD)
        save_group(kwargs.get("timeout"))  # now, with the user's timeout: not mid-run at the first background save

    def open_one_process_group(self, backend: Optional[str] = None, **kwargs: Any) -> None:
        """A process group of this one process (FSDP2 and DTensor need one even then), in memory: no
        rendezvous, no port. A group that already exists (the user's) is kept as it is."""
        if self.use_distributed or not dist.is_available():
            return
        if not dist.is_initialized():
            backend = backend or choose_backend(self.device.type)
            _check_timeout(kwargs)
            if kwargs.get("init_method") is None:
                kwargs.pop("init_method", None)
                kwargs["store"] = dist.HashStore()
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend=backend, rank=0, world_size=1, **kwargs)
            atexit.register(tear_down_at_exit, dist.group.WORLD)
            self.owns_group = True
        self.backend = dist.get_backend()

    # -- identity -------------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return "device" in self.__dict__

    @property
    def num_processes(self) -> int:
        return self.topology.world_size

    @property
    def process_index(self) -> int:
        return self.topology.rank

    @property
    def local_process_index(self) -> int:
        return self.topology.local_rank

    @property
    def num_machines(self) -> int:
        return self.topology.num_nodes

    @property
    def use_distributed(self) -> bool:
        return self.topology.distributed

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def default_device(self) -> torch.device:
        return self.device

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type}{('  Backend: ' + self.backend) if self.backend else ''}\n"
            f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
        )

    # -- synchronisation ------------------------------------------------------------------------
    @progress.collective("wait_for_everyone")
    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point.

        After ``end_training()`` (or ``destroy_process_group()``) the group is gone and every process has
        already met there; scripts such as transformers' ``run_*_no_trainer.py`` still call this before
        saving, so it returns at once (with a warning) rather than failing inside torch."""
        if self.use_distributed and getattr(self, "group_closed", False) and not dist.is_initialized():
            warnings.warn("wait_for_everyone() after end_training(): the process group is closed and every "
                          "process already met in end_training(), so this returns at once. Call "
                          "end_training() last to keep later synchronisation", stacklevel=_user_stacklevel())
            return
        if self.use_distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def _goes_first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on the others (e.g. dataset caching)."""
        yield from self._goes_first(self.is_main_process)

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Like ``main_process_first`` but once per node."""
        yield from self._goes_first(self.is_local_main_process)

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of a list, tuple, dict of lists or tensor.

        With ``apply_padding`` every share has the same length, padded with the last element, so
        that the results can be gathered (drop the padding afterwards).
        """
        # Tensor-parallel peers share one replica's inputs (the running Accelerator's view).
        with split_among(data_parallel(), inputs, apply_padding) as share:
            yield share

    # -- running on some processes only ---------------------------------------------------------
    # The process is checked when the function is called, not when it is decorated, so a function
    # decorated before the process group exists still does the right thing. With one process every
    # decorated function runs (as in Accelerate), whichever process it names.
    def _run_if(self, condition: Callable[[], bool], function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.use_distributed or condition():
                return function(*args, **kwargs)
            return None

        return wrapper

    def on_main_process(self, function: Optional[Callable] = None) -> Callable:
        """Decorator: run only on the main process (``@on_main_process`` or ``@on_main_process()``)."""
        if function is None:
            return self.on_main_process
        return self._run_if(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: Optional[Callable] = None) -> Callable:
        """Decorator: run only on each node's main process."""
        if function is None:
            return self.on_local_main_process
        return self._run_if(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: run only on the last process."""
        return self._run_if(lambda: self.is_last_process, function)

    def on_process(self, function: Optional[Callable] = None, process_index: Optional[int] = None) -> Callable:
        """Decorator: run only on process ``process_index`` (``@on_process(process_index=1)``)."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        _check_index("on_process", "process_index", process_index)
        return self._run_if(lambda: self.process_index == process_index, function)

    def on_local_process(self, function: Optional[Callable] = None, local_process_index: Optional[int] = None) -> Callable:
        """Decorator: run only on local process ``local_process_index`` of each node."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        _check_index("on_local_process", "local_process_index", local_process_index)
        return self._run_if(lambda: self.local_process_index == local_process_index, function)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def set_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def destroy_process_group(self, group: Any = None) -> None:
        """Tear the process group down (idempotent), once background saves are committed (they need it)."""
        saves = sys.modules.get("hasten.checkpointing.commit")
        if saves is not None:
            saves.wait_all()
        if (self.use_distributed or getattr(self, "owns_group", False)) and dist.is_initialized():
            dist.destroy_process_group(group)
            if group is None:
                self.owns_group = False
                self.group_closed = True

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the singleton (tests); the process group stays."""
        cls._shared_state.clear()


def _user_stacklevel() -> int:
    """``warnings.warn`` stacklevel naming the first caller outside hasten (the user's line), however
    many hasten wrappers (Accelerator, collective decorators) lie between."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _check_timeout(kwargs: dict) -> None:
    """Drop an unset ``timeout`` from ``init_process_group``'s arguments; refuse one of the wrong type."""
    if kwargs.get("timeout") is None:
        kwargs.pop("timeout", None)
    elif not isinstance(kwargs["timeout"], timedelta):
        raise TypeError(f"timeout={kwargs['timeout']!r} must be a datetime.timedelta, e.g. timedelta(minutes=30)")


def _check_index(decorator: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{decorator}: {name}={value!r} is not a process index; write @{decorator}({name}=1)")


@contextmanager
def split_among(dp: DataParallel, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
    """``split_between_processes`` over the data-parallel processes of ``dp`` (the Accelerator passes
    its strategy's view)."""
    yield inputs if dp.size == 1 else _split(inputs, dp.size, dp.rank, apply_padding)


def _split(inputs: Any, n: int, index: int, pad: bool) -> Any:
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                f"split_between_processes got a dict whose values have different lengths {sorted(lengths)}; "
                "give every value the same length"
            )
        return {k: _split(v, n, index, pad) for k, v in inputs.items()}
    if not hasattr(inputs, "__len__") or not hasattr(inputs, "__getitem__"):
        raise TypeError(
            f"split_between_processes cannot split a {type(inputs).__name__}; "
            "pass a list, tuple, dict of lists or a tensor"
        )
    total = len(inputs)
    per, extra = divmod(total, n)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    share = inputs[start:end]
    if pad and extra and total:
        missing = per + 1 - (end - start)
        if missing:
            filler = share[-1:] if len(share) else inputs[-1:]
            if isinstance(share, torch.Tensor):
                share = torch.cat([share] + [filler] * missing)
            else:
                share = share + type(share)(list(filler) * missing)
    return share


class AcceleratorState(SharedDict):
    """``PartialState`` plus the precision and parallel-strategy settings of the run."""

    # The process state this one extends; None until ``__init__`` fills the shared dict, and again
    # after ``_reset_state()`` (a class-level default: reading it never reaches ``__getattr__``).
    _partial: Optional[PartialState] = None

    def __init__(
        self,
        mixed_precision: Optional[str] = None,
        cpu: bool = False,
        dynamo_plugin: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        _from_accelerator: bool = False,
        **kwargs: Any,
    ) -> None:
        self._bind_shared()
        fsdp = fsdp_plugin if deepspeed_plugin is None else None
        made = PartialState._shared_state.get("device") is not None
        partial = PartialState(cpu, _fsdp_plugin=fsdp, **kwargs)
        wanted, offload = fsdp_wanted(fsdp)
        if made and not self.initialized and wanted:
            # PartialState() came first (without the plugin): FSDP on one process still needs its group.
            extra = dict(kwargs)
            backend = extra.pop("backend", None) or choose_backend(partial.device.type, offload)
            partial.open_one_process_group(backend, **extra)
        if self.initialized:
            # As Accelerate: a later Accelerator without mixed_precision joins the existing state;
            # only an explicit, different value contradicts it.
            asked = resolve_mixed_precision(mixed_precision) if mixed_precision is not None else None
            if asked is not None and asked != self._mixed_precision and _from_accelerator:
                raise ValueError(
                    f"AcceleratorState already runs with mixed_precision={self._mixed_precision!r}; "
                    f"a second Accelerator asked for {asked!r}. Leave mixed_precision out (it keeps "
                    f"{self._mixed_precision!r}), or restart the interpreter to change it"
                )
            return
        mixed_precision = resolve_mixed_precision(mixed_precision)
        self._partial = partial
        self._mixed_precision = mixed_precision
        self.dynamo_plugin = dynamo_plugin
        self.deepspeed_plugin = deepspeed_plugin
        # Accelerate's several named plugins (``deepspeed_plugins={"student": ..., "teacher": ...}``): the
        # planner fills it; ``deepspeed_plugin`` is then the selected one.
        self.deepspeed_plugins: Optional[dict[str, Any]] = None
        self.fsdp_plugin = fsdp_plugin
        # The same decision the Accelerator's plan reads (hasten.planning): one rule, two callers.
        self.distributed_type = distributed_type_for(partial.distributed_type, deepspeed_plugin, fsdp_plugin)

    @property
    def initialized(self) -> bool:
        return self._partial is not None

    @property
    def mixed_precision(self) -> str:
        return self._mixed_precision

    def __getattr__(self, name: str) -> Any:
        # Everything PartialState knows (device, process_index, ...) is readable here too.
        if name.startswith("__"):
            raise AttributeError(name)
        partial = self._partial
        if partial is None:
            if name in _PARTIAL_FIELDS or name == "_mixed_precision" or hasattr(PartialState, name):
                raise self._reset_error(name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(partial, name)
        except AttributeError:
            if not partial.initialized:  # the reset explanation stays as it is
                raise
            # Named after the object the user asked, not the one it delegates to.
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None

    def __repr__(self) -> str:
        return repr(self._partial) + f"Mixed precision type: {self.mixed_precision}\n"

    def get_deepspeed_plugin(self, name: str) -> Any:
        """The ``DeepSpeedPlugin`` given under ``name`` in ``Accelerator(deepspeed_plugins={...})``."""
        from .utils.deepspeed_compat import named_plugins

        return named_plugins(self, name)[name]

    def select_deepspeed_plugin(self, name: Optional[str] = None) -> None:
        """Make the plugin named ``name`` the active one (the next engines ``prepare`` builds use it)."""
        from .utils.deepspeed_compat import select_plugin

        self.deepspeed_plugin = select_plugin(self, name)

    def destroy_process_group(self, group: Any = None) -> None:
        """``PartialState().destroy_process_group(group)``: works after ``AcceleratorState._reset_state()``
        too, since the process state outlives it (as in Accelerate)."""
        PartialState().destroy_process_group(group)

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


def data_parallel() -> DataParallel:
    """This process's data-parallel view for callers that were given none (``prepare_data_loader``,
    ``gather_for_metrics``, ``PartialState.split_between_processes`` called directly): the running
    Accelerator's mesh (``AcceleratorState.parallel_mesh``) when there is one, else every process its
    own replica. The Accelerator passes its strategy's view to the data layer explicitly."""
    mesh = AcceleratorState._shared_state.get("parallel_mesh")
    if mesh is not None:
        return mesh.data_parallel()
    state = PartialState()
    return DataParallel(state.process_index, state.num_processes)

def resolve_mixed_precision(value: Optional[str]) -> str:
    """The argument, else ``HASTEN_MIXED_PRECISION``/``ACCELERATE_MIXED_PRECISION``, else "no"."""
    source = "mixed_precision"
    if value is None:
        value = parse_choice("MIXED_PRECISION", "no")
        source = "environment variable HASTEN_MIXED_PRECISION/ACCELERATE_MIXED_PRECISION"
    value = str(value).lower()
    if value not in PrecisionType.list():
        raise ValueError(
            f"{source}={value!r} is not a known precision; choose one of {PrecisionType.list()}"
        )
    return value


class GradientState(SharedDict):
    """Whether this micro-step syncs gradients, and which prepared dataloader is running."""

    def __init__(self, gradient_accumulation_plugin: Optional[GradientAccumulationPlugin] = None) -> None:
        self._bind_shared()
        if not self.initialized:
            self.sync_gradients = True
            self.active_dataloader = None
            self.dataloader_references: list[Any] = [None]
            self.plugin_kwargs = (gradient_accumulation_plugin or GradientAccumulationPlugin()).to_dict()
            self._is_xla_gradients_synced = False
        elif gradient_accumulation_plugin is not None:
            self.plugin_kwargs = gradient_accumulation_plugin.to_dict()

    @property
    def initialized(self) -> bool:
        return "sync_gradients" in self.__dict__

    @property
    def num_steps(self) -> int:
        return self.plugin_kwargs.get("num_steps") or 1

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin_kwargs.get("adjust_scheduler", True)

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    @property
    def sync_each_batch(self) -> bool:
        return self.plugin_kwargs.get("sync_each_batch", False)

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self.active_dataloader is not None and self.active_dataloader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        return -1 if self.active_dataloader is None else self.active_dataloader.remainder

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader: Any) -> None:
        self.active_dataloader = dataloader
        self.dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader: Any) -> None:
        if dataloader in self.dataloader_references:
            self.dataloader_references.remove(dataloader)
        self.active_dataloader = self.dataloader_references[-1]

    def __repr__(self) -> str:
        return (
            f"Sync gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared_state.clear()


def is_initialized() -> bool:
    """Whether an ``AcceleratorState`` exists in this process."""
    return AcceleratorState().initialized if AcceleratorState._shared_state else False


def warn_once(message: str, _seen: set = set()) -> None:  # noqa: B006 - the set is the memory
    if message not in _seen:
        _seen.add(message)
        warnings.warn(message, HastenWarning, stacklevel=3)
