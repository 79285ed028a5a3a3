"""``HfDeepSpeedConfig``: a DeepSpeed configuration that can be asked for values by dotted key.

Accelerate defines this class and transformers subclasses it (``transformers.integrations.HfDeepSpeedConfig``,
the one that registers itself for ``is_deepspeed_zero3_enabled``), so ``accelerate.utils.deepspeed`` must
answer a base class of its own, not transformers' (which would make transformers' class inherit from itself
when a library built on Accelerate runs on hasten). Standard library only.
"""

from __future__ import annotations

import base64
import copy
import json
import os
from typing import Any, Optional, Union


def _read_config(source: Union[str, dict]) -> dict:
    if isinstance(source, dict):
        return copy.deepcopy(source)  # the caller's dict stays reusable ("auto" values get filled in)
    if isinstance(source, str) and os.path.exists(source):
        with open(source, encoding="utf-8") as f:
            return json.load(f)
    if isinstance(source, str):
        for decode in (lambda s: s, lambda s: base64.urlsafe_b64decode(s).decode("utf-8")):
            try:
                return json.loads(decode(source))
            except (ValueError, UnicodeDecodeError):
                continue
    raise ValueError(f"DeepSpeed config {str(source)[:80]!r}: pass a dict, the path of a JSON file that exists, "
                     f"or a JSON (or base64-encoded JSON) string")


class HfDeepSpeedConfig:
    """A DeepSpeed configuration (dict, JSON file path, or JSON / base64 JSON string) with lookups by
    dotted key (``get_value("zero_optimization.stage")``) and the ZeRO stage / offload questions."""

    def __init__(self, config_file_or_dict: Union[str, dict]) -> None:
        self.config = _read_config(config_file_or_dict)
        self.set_stage_and_offload()

    def set_stage_and_offload(self) -> None:
        """Read the ZeRO stage (-1 when unset) and whether parameters or optimizer state go to cpu / nvme."""
        self._stage = self.get_value("zero_optimization.stage", -1)
        devices = {self.get_value("zero_optimization.offload_optimizer.device"),
                   self.get_value("zero_optimization.offload_param.device")}
        self._offload = (self.is_zero2() or self.is_zero3()) and bool(devices & {"cpu", "nvme"})

    def find_config_node(self, ds_key_long: str) -> tuple[Optional[dict], str]:
        """The dict holding the last part of ``ds_key_long`` (None if a parent is missing), and that part."""
        *parents, key = ds_key_long.split(".")
        node: Any = self.config
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return node, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at ``ds_key_long``, or ``default`` when it is not set."""
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Remove the entry at ``ds_key_long``; a missing one raises only with ``must_exist=True``."""
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ValueError(f"{ds_key_long!r} is not in the DeepSpeed config {self.config}")
            return
        node.pop(key)

    def is_true(self, ds_key_long: str) -> bool:
        """True only when the value is set and true."""
        value = self.get_value(ds_key_long)
        return value is not None and bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        """True only when the value is set and false."""
        value = self.get_value(ds_key_long)
        return value is not None and not bool(value)

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload
