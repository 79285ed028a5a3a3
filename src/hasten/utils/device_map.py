"""Planning where each module of a big model goes: ``get_max_memory``, ``get_balanced_memory``,
``infer_auto_device_map``.

The planner fills accelerators in index order, then the CPU, then the disk, walking the model's
top-level modules in definition order and splitting a module into its children only when it does
not fit (never a class named in ``no_split_module_classes``). Two rules make the plan runnable:
tied parameters land on one device together (their modules are placed as one unit), and the
devices that run offloaded layers (the first accelerator, and the CPU, which stages layers read
from disk) keep room for the largest layer still to be placed. Sizes come from
``compute_module_sizes``; the model may be on ``meta``.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

from .modeling import compute_module_sizes, compute_module_total_buffer_size, find_tied_parameters, get_max_layer_size
from ..warning_kinds import HastenWarning

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

MemoryMap = dict[Union[int, str], Union[int, str]]
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b)\s*", re.IGNORECASE)
_UNIT = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def convert_file_size_to_int(size: Union[int, str]) -> int:
    """Bytes from an int or a string like ``"5GB"`` (10^9), ``"5GiB"`` (2^30), ``"500MB"``, ``"64KiB"``."""
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return size
    if isinstance(size, float) and size >= 0:
        return int(size)
    match = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"size {size!r} is not a number of bytes; pass an int or a string such as '10GB', '500MiB'")
    unit = match.group(2).lower()[:-1]
    number = float(match.group(1)) * _UNIT[unit]
    # Accelerate reads a lower-case "b" after a decimal unit ("5Gb") as bits.
    return int(number // 8 if match.group(2).endswith("b") and "i" not in unit else number)


def _accelerator_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus_visible(device_map: Mapping[str, Any]) -> None:
    """Refuse a map that places modules on GPUs this process cannot see, before anything moves (torch
    would fail mid-way with "Torch not compiled with CUDA enabled" or an invalid device ordinal)."""
    count = _accelerator_count()
    absent = {name: device for name, device in device_map.items()
              if isinstance(device, int) and not isinstance(device, bool) and device >= count}
    if absent:
        name, device = next(iter(absent.items()))
        raise ValueError(f"the device map puts {len(absent)} module(s) on GPUs this process cannot see (e.g. "
                         f"{name or 'the whole model'!r} on GPU {device}; {count} CUDA device(s) visible); plan for "
                         "this machine (device_map='auto' with max_memory naming only its devices, or 'cpu'/'disk')")


def get_max_memory(max_memory: Optional[MemoryMap] = None) -> dict[Union[int, str], int]:
    """Memory each device may use, in bytes, ordered accelerators (by index), ``"mps"``, ``"cpu"``, ``"disk"``.

    Without ``max_memory``: the free memory of every visible GPU and the available host RAM. With
    it: its sizes in bytes (strings like ``"10GiB"`` converted); keys are GPU indices, ``"mps"``,
    ``"cpu"`` or ``"disk"``. The dict passed in is not modified.
    """
    import torch

    if max_memory is None:
        from ..commands.hardware import available_memory_bytes

        found: dict[Union[int, str], int] = {}
        for index in range(_accelerator_count()):
            try:
                found[index] = torch.cuda.mem_get_info(index)[0]
            except RuntimeError:  # a GPU that cannot be used right now: plan without it
                logger.info("GPU %d did not report its free memory; it gets no layers", index)
        mps = getattr(torch.backends, "mps", None)
        key = "mps" if mps is not None and mps.is_available() else "cpu"  # MPS shares host RAM
        available = available_memory_bytes()
        if available is None:
            raise RuntimeError("device_map='auto' could not read how much host memory is available on this system; "
                               "pass max_memory, e.g. max_memory={0: '20GiB', 'cpu': '60GiB'}")
        found[key] = available
        return found
    wrong = [k for k in max_memory if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0)
             and k not in ("mps", "cpu", "disk")]
    if wrong:
        raise ValueError(f"max_memory has keys {wrong}; use GPU indices (0, 1, ...), 'mps', 'cpu' and 'disk', "
                         "e.g. max_memory={0: '20GiB', 'cpu': '60GiB'}")
    count = _accelerator_count()
    missing = sorted(k for k in max_memory if isinstance(k, int) and k >= count)
    if missing:
        logger.warning("max_memory names GPUs %s, but only %d are visible", missing, count)
    sizes = {k: convert_file_size_to_int(v) for k, v in max_memory.items()}
    order = sorted(k for k in sizes if isinstance(k, int)) + [k for k in ("mps", "cpu", "disk") if k in sizes]
    return {k: sizes[k] for k in order}


def _class_names(no_split_module_classes: Union[str, list[str], None]) -> list[str]:
    if no_split_module_classes is None:
        return []
    if isinstance(no_split_module_classes, str):
        return [no_split_module_classes]
    return list(no_split_module_classes)


def _submodule(model: "nn.Module", name: str) -> Any:
    node: Any = model
    for part in name.split("."):
        node = getattr(node, part)
    return node


def get_balanced_memory(
    model: "nn.Module",
    max_memory: Optional[MemoryMap] = None,
    no_split_module_classes: Optional[list[str]] = None,
    dtype: Union[str, "torch.dtype", None] = None,
    special_dtypes: Optional[dict[str, Union[str, "torch.dtype"]]] = None,
    low_zero: bool = False,
) -> dict[Union[int, str], int]:
    """A ``max_memory`` for ``infer_auto_device_map`` that spreads the model evenly over the GPUs.

    Each GPU but the last gets the model's size divided by the number of GPUs, plus a margin of
    1.25 x the larger of the biggest no-split block and the mean size of the innermost modules (so
    that layers do not spill onto the next device); the last keeps its full budget. With one GPU
    and no ``max_memory`` given, 90% of it is used. ``low_zero`` keeps GPU 0 as empty as the
    others allow (room for ``generate``). Without accelerators the budgets come back unchanged.
    """
    user_given = max_memory is not None
    budgets = get_max_memory(max_memory)
    gpus = sorted(k for k, v in budgets.items() if isinstance(k, int) and v > 0)
    count = len(gpus) + (1 if budgets.get("mps", 0) > 0 else 0)
    if count == 0:
        return budgets
    if count == 1:
        low_zero = False
        if not user_given and gpus:
            budgets[gpus[0]] = int(budgets[gpus[0]] * 0.9)  # leave room for activations
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    share = sizes[""] // (count - 1 if low_zero else count)

    first_of_class: dict[str, int] = {}
    wanted = set(_class_names(no_split_module_classes))
    for name, size in sizes.items():
        if not name or not wanted:
            continue
        kind = type(_submodule(model, name)).__name__
        if kind in wanted:
            first_of_class.setdefault(kind, size)
            if len(first_of_class) == len(wanted):
                break
    block = max(first_of_class.values(), default=0)
    # Innermost modules: strip the tensor names (the leaves), then take the new leaves.
    parents = {n.rpartition(".")[0] for n in sizes if "." in n}
    modules = {n: s for n, s in sizes.items() if not n or n in parents}
    parents = {n.rpartition(".")[0] for n in modules if "." in n}
    innermost = [s for n, s in modules.items() if n and n not in parents]
    mean = int(sum(innermost) / max(len(innermost), 1))
    share += int(1.25 * max(block, mean))

    for index in gpus[:-1]:  # the last GPU keeps its budget in case the margin was not enough
        budgets[index] = min(budgets[index] if low_zero and index == gpus[0] else share, budgets[index])
    if low_zero:
        rest = sum(budgets[i] for i in gpus[1:])
        budgets[gpus[0]] = min(max(0, sizes[""] - rest), budgets[gpus[0]])
    return budgets


def _parts(name: str, node: Any, with_buffers: bool = True) -> list[tuple[str, Any]]:
    """What replaces a split module in the queue: its direct parameters, children (and direct buffers)."""
    prefix = f"{name}." if name else ""
    items = list(node.named_parameters(recurse=False)) + list(node.named_children())
    if with_buffers:
        persistent = [(n, b) for n, b in node.named_buffers(recurse=False) if n not in node._non_persistent_buffers_set]
        items += persistent
    return [(prefix + n, c) for n, c in items]


def _splittable(node: Any, no_split: list[str]) -> bool:
    from torch import nn

    return isinstance(node, nn.Module) and bool(list(node.children())) and type(node).__name__ not in no_split


def _inside(name: str, tensor_name: str) -> bool:
    return (tensor_name + ".").startswith(name + ".")


def get_module_size_with_ties(tied_params: list[str], module_size: int, module_sizes: Mapping[str, int],
                              modules_to_treat: list[tuple[str, Any]]) -> tuple[int, list[str], list[Any]]:
    """The bytes a module takes when it is placed together with the modules its ties pull along.

    tied_params: names of tensors outside the module that are tied to one of its tensors;
    module_size: the module's own bytes; module_sizes: bytes by module and tensor name (as
    ``compute_module_sizes`` gives them); modules_to_treat: the ``(name, module)`` entries still to be
    placed. Each tied tensor's module is the entry whose name is a dotted prefix of it (``"1"`` holds
    ``"1.weight"``, not ``"10.weight"``); its bytes count, less the tied tensor already counted in
    the module. Returns ``(total bytes, names of those modules, the modules)``, each module once.
    """
    total, names, modules = module_size, [], []
    for tensor in tied_params:
        entry = next(((n, m) for n, m in modules_to_treat if _inside(n, tensor)), None)
        if entry is None:
            raise ValueError(f"tied parameter {tensor!r} is in none of the modules to treat "
                             f"{[n for n, _ in modules_to_treat]}; pass the entries that hold every tied parameter")
        if entry[0] in names:  # a module holding several tied tensors counts once
            continue
        total += module_sizes[entry[0]] - module_sizes[tensor]
        names.append(entry[0])
        modules.append(entry[1])
    return total, names, modules


class _Planner:
    """The state of one ``infer_auto_device_map`` run (a class so that each step reads as one method)."""

    def __init__(self, model: "nn.Module", budgets: dict, no_split: list[str], sizes: dict, verbose: bool) -> None:
        self.budgets, self.no_split, self.sizes, self.verbose = budgets, no_split, sizes, verbose
        self.devices = list(budgets) + ([] if "disk" in budgets else ["disk"])
        accelerators = [d for d in self.devices if d not in ("cpu", "disk")]
        # Devices that must keep room to load one offloaded layer at a time.
        self.staging = {"mps"} if "mps" in accelerators else {accelerators[0], "cpu"} if accelerators else {"cpu"}
        self.ties = find_tied_parameters(model)
        self.queue = _parts("", model, with_buffers=True)
        self.used = {d: 0 for d in self.devices}
        # Room a staging device kept for loading offloaded layers, fixed when the planner leaves it;
        # the buffers of offloaded modules (which stay on the device) must fit beside it.
        self.reserved: dict[Any, int] = {}
        # Bytes a device would have needed to take its first module, for devices left empty.
        self.needed: dict[Any, int] = {}
        self.plan: dict[str, Any] = {}
        self.current = 0
        self.fallback_allocation = False
        self.largest = 0
        self.refresh_largest()

    def say(self, text: str) -> None:
        if self.verbose:
            print(text)

    def refresh_largest(self) -> None:
        from torch import nn

        modules = [(n, m) for n, m in self.queue if isinstance(m, nn.Module)]
        self.largest = get_max_layer_size(modules, self.sizes, self.no_split)[0]

    def partners(self, name: str) -> list[tuple[str, str, Any]]:
        """(tied tensor outside ``name``, queue entry holding it, that entry's module) for each tie of ``name``."""
        found = []
        for group in self.ties:
            inside = [t for t in group if _inside(name, t)]
            if not inside or len(inside) == len(group):
                continue
            for tensor in group:
                if _inside(name, tensor):
                    continue
                entry = next(((n, m) for n, m in self.queue if _inside(n, tensor)), None)
                if entry is not None and all(entry[0] != f[1] for f in found):
                    found.append((tensor, entry[0], entry[1]))
        return found

    def replace(self, name: str, parts: list[tuple[str, Any]]) -> None:
        index = next(i for i, (n, _) in enumerate(self.queue) if n == name)
        self.queue[index:index + 1] = parts
        self.refresh_largest()

    def step(self) -> None:
        name, node = self.queue.pop(0)
        self.refresh_largest()  # the largest of what is left after this one
        device = self.devices[self.current]
        reserve = self.largest if device in self.staging else 0
        limit = None if device == "disk" else self.budgets[device] - reserve
        size = self.sizes[name]
        partners = self.partners(name)
        with_ties = get_module_size_with_ties([tensor for tensor, _, _ in partners], size, self.sizes, self.queue)[0]
        if limit is None or self.used[device] + with_ties <= limit:
            self.say(f"Putting {name} ({with_ties} bytes with its ties) on {device}")
            self.used[device] += with_ties
            self.plan[name] = device
            for _, entry, _ in partners:
                self.queue = [(n, m) for n, m in self.queue if n != entry]
                self.plan[entry] = device
            self.refresh_largest()
            return
        if partners and self.used[device] + size <= limit:
            for _, entry, module in partners:  # split a tied partner, then try again
                if _splittable(module, self.no_split):
                    self.say(f"Splitting tied module {entry}")
                    self.queue.insert(0, (name, node))
                    self.replace(entry, _parts(entry, module))
                    return
        if self.used[device] + size >= limit and _splittable(node, self.no_split):
            self.say(f"Splitting {name} ({size} bytes; {limit - self.used[device]} left on {device})")
            self.queue[0:0] = _parts(name, node)
            self.refresh_largest()
            return
        self.queue.insert(0, (name, node))
        if self.fallback_allocation and self.fallback():
            return
        self.say(f"{name} does not fit on {device}; moving to the next device")
        if not self.used[device]:
            self.needed[device] = with_ties + reserve
        self.reserved[device] = reserve
        self.current += 1

    def fallback(self) -> bool:
        """Before leaving an empty device: move forward the first module (breadth first) that fits on it."""
        device = self.devices[self.current]
        if device == "disk" or self.used[device]:
            return False
        name, node = self.queue[0]
        limit = self.budgets[device] - max(self.largest, self.sizes[name])
        search = list(self.queue[1:])
        while search:
            cand, module = search.pop(0)
            if self.sizes[cand] <= limit and not self.partners(cand):
                break
            if _splittable(module, self.no_split):
                search = _parts(cand, module, with_buffers=False) + search
        else:
            return False
        while not any(n == cand for n, _ in self.queue):  # open the ancestors of the candidate
            parent, module = next((n, m) for n, m in self.queue if cand.startswith(n + "."))
            self.replace(parent, _parts(parent, module, with_buffers=False))
        entry = next(e for e in self.queue if e[0] == cand)
        self.queue.remove(entry)
        self.queue.insert(0, entry)
        return True


def infer_auto_device_map(
    model: "nn.Module",
    max_memory: Optional[MemoryMap] = None,
    no_split_module_classes: Optional[list[str]] = None,
    dtype: Union[str, "torch.dtype", None] = None,
    special_dtypes: Optional[dict[str, Union[str, "torch.dtype"]]] = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict[str, Union[int, str]]:
    """A device map ``{module name: device}``: GPUs first (by index), then ``"cpu"``, then ``"disk"``.

    No device gets more than its ``max_memory`` (default: what is free); the first GPU and the CPU
    keep room for the largest layer still to place, so an offloaded layer can be loaded there for its
    forward. Modules whose class is in ``no_split_module_classes`` stay whole; tied parameters land on
    one device. ``clean_result`` merges children that share a device into their parent.
    ``offload_buffers``: buffers of offloaded modules are offloaded too (otherwise the planner warns
    when they do not fit on a GPU). ``fallback_allocation``: before leaving a device empty because
    the next module is too big, put there the first smaller module found breadth first.
    """
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    planner = _Planner(model, get_max_memory(max_memory), _class_names(no_split_module_classes), sizes, verbose)
    if not planner.ties and getattr(getattr(model, "config", None), "tie_word_embeddings", False) \
            and callable(getattr(model, "tie_weights", None)):
        logger.warning("the model's config ties word embeddings but its weights are not tied; call "
                       "model.tie_weights() before planning the device map")
    planner.fallback_allocation = fallback_allocation
    while planner.queue:
        planner.step()
    device_map = planner.plan
    if clean_result:
        device_map = clean_device_map(device_map)
    if not offload_buffers:
        _warn_offloaded_buffers(model, device_map, planner, dtype, special_dtypes)
    if planner.needed:
        logger.info("no module could be placed on %s: insufficient memory (the first module to place, with the room "
                    "kept for loading offloaded layers, needs %s bytes there); raise their max_memory to use them",
                    ", ".join(map(str, planner.needed)), ", ".join(map(str, planner.needed.values())))
    return device_map


def _warn_offloaded_buffers(model: "nn.Module", device_map: dict, planner: _Planner, dtype: Any, special: Any) -> None:
    from torch import nn

    offloaded = [n for n, d in device_map.items() if d in ("cpu", "disk")]
    gpus = [d for d in planner.devices if d not in ("cpu", "disk")]
    if not offloaded or not gpus:
        return
    total = sum(compute_module_total_buffer_size(_submodule(model, n) if n else model, dtype, special)
                for n in offloaded if n == "" or isinstance(_submodule(model, n), nn.Module))
    if total and not any(planner.budgets[g] >= total + planner.used[g] + planner.reserved.get(g, 0) for g in gpus):
        warnings.warn(f"the offloaded modules hold {total} bytes of buffers, which stay on the GPU and do not fit "
                      "in any GPU's remaining budget; pass offload_buffers=True if you run out of memory",
                      HastenWarning, stacklevel=3)


def clean_device_map(device_map: dict[str, Any], module_name: str = "") -> dict[str, Any]:
    """Merge entries under ``module_name`` into one when they all name the same device (recursively)."""
    prefix = f"{module_name}." if module_name else ""
    inside = [k for k in device_map if k.startswith(prefix)]
    if len(inside) > 1 and len({str(device_map[k]) for k in inside}) == 1:
        value = device_map[inside[0]]
        rebuilt: dict[str, Any] = {}
        for key, device in device_map.items():
            if key in inside:
                rebuilt.setdefault(module_name, value)
            else:
                rebuilt[key] = device
        device_map.clear()
        device_map.update(rebuilt)
        return device_map
    children = dict.fromkeys(prefix + k[len(prefix):].split(".")[0] for k in inside if len(k) > len(prefix))
    for child in children:
        if child not in device_map:
            clean_device_map(device_map, child)
    return device_map
