"""Which process am I, and running code on some processes only: the ``Accelerator``'s share of it.

Everything here delegates to ``PartialState``; the mixin only gives the Accelerator the same
names, so the facade itself stays about training.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Optional

from .state import split_among


class ProcessControlMixin:
    """Process identity and control, read from ``self.state``."""

    state: Any
    strategy: Any

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point."""
        self.state.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine."""
        self.state.print(*args, **kwargs)

    def main_process_first(self) -> AbstractContextManager:
        """Run the block on the main process first, then on the others."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> AbstractContextManager:
        """Run the block on each node's main process first, then on the others."""
        return self.state.local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> AbstractContextManager:
        """Give each process its share of ``inputs`` (see ``PartialState.split_between_processes``)."""
        # The strategy's data-parallel view, passed explicitly: tensor-parallel peers get the same share.
        return split_among(self.strategy.mesh.data_parallel(), inputs, apply_padding=apply_padding)

    def on_main_process(self, function: Optional[Callable] = None) -> Callable:
        """Decorator: run only on the main process (``@accelerator.on_main_process`` or with ``()``)."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Optional[Callable] = None) -> Callable:
        """Decorator: run only on each node's main process."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: run only on the last process."""
        return self.state.on_last_process(function)

    def on_process(self, function: Optional[Callable] = None, process_index: Optional[int] = None) -> Callable:
        """Decorator: run only on process ``process_index``."""
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: Optional[Callable] = None, local_process_index: Optional[int] = None) -> Callable:
        """Decorator: run only on local process ``local_process_index``."""
        return self.state.on_local_process(function, local_process_index=local_process_index)
