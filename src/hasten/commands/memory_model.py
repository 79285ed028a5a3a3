"""Per-process training memory of a model under each parallel strategy (torch-free arithmetic).

``hasten estimate-memory`` measures a model built on the meta device into a ``ModelSizes`` and
``estimate`` turns it into bytes per process. The rules, also printed with the table:

- float32 training: weights 4 bytes, gradients 4 bytes and Adam's two states 8 bytes per parameter
  (and a 4-byte step counter per parameter tensor).
- float16/bfloat16 (mixed precision): weights and gradients in that dtype (2 + 2 bytes) and Adam
  holding an fp32 master copy and two fp32 states (12 bytes). The total, 16 bytes per parameter,
  is also what hasten's autocast (fp32 weights and gradients, no separate master copy) and FSDP2's
  ``MixedPrecisionPolicy`` (fp32 shards) hold; only the split between the columns differs.
- int8/int4: loading only (no gradients or optimizer state for quantised weights).
- DDP holds every gradient twice: in ``.grad`` and in its communication buckets (one copy with
  ``DistributedDataParallelKwargs(gradient_as_bucket_view=True)``).
- ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the weights (flat
  split: ceil(n / N) each); FSDP2 shards every parameter along its first dimension, padded to a
  multiple of N (the largest shard, rank 0's, is reported). ZeRO-3 and FSDP2 also hold one gathered
  layer at a time: its weights and its unreduced gradients, in the training dtype.
- Buffers are replicated everywhere; activations, temporary buffers and the framework's own
  memory (CUDA context, communication buffers) are not included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
TRAINABLE_DTYPES = ("float32", "float16", "bfloat16")
BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5}
STRATEGIES = ("single", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2")
COLUMNS = ("parameters", "gradients", "optimizer", "gathered_layer", "total")

ASSUMPTIONS = (
    "Adam; float32: weights 4 + gradients 4 + two fp32 states 8 bytes per parameter (+ a 4-byte step counter per "
    "parameter tensor)",
    "float16/bfloat16 (mixed precision): weights 2 + gradients 2 + fp32 master copy and two fp32 states 12 bytes "
    "per parameter (the same 16-byte total as hasten's autocast, fp32 weights and gradients, and FSDP2's fp32 "
    "shards; only the split differs)",
    "int8/int4: loading only, no training",
    "DDP: gradients twice, in .grad and in the communication buckets (once with "
    "DistributedDataParallelKwargs(gradient_as_bucket_view=True))",
    "ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 and FSDP2 also the weights; ZeRO-3 and "
    "FSDP2 add one gathered layer (its weights and unreduced gradients; prefetching can hold two)",
    "buffers replicated; activations, temporary buffers and the framework's own memory not included",
)


@dataclass
class ModelSizes:
    """What the estimate needs to know about a model (element counts, no tensors)."""

    name: str
    trainable: list[tuple[int, int]] = field(default_factory=list)  # (numel, size of dim 0) per parameter
    frozen: list[tuple[int, int]] = field(default_factory=list)
    float_buffers: int = 0  # elements of floating-point buffers (they follow the model's dtype)
    other_buffer_bytes: int = 0  # integer/bool buffers keep their own dtype
    largest_layer: tuple[str, int] = ("", 0)  # (name, parameter elements) of the largest gathered unit
    layer_rule: str = ""

    @property
    def num_parameters(self) -> int:
        return sum(n for n, _ in self.trainable) + sum(n for n, _ in self.frozen)

    @property
    def num_trainable(self) -> int:
        return sum(n for n, _ in self.trainable)


def _ceil(value: float) -> int:
    return int(math.ceil(value))


def fsdp2_shard(params: list[tuple[int, int]], num_processes: int) -> int:
    """Elements of the largest per-process FSDP2 shard: every parameter is split along dim 0, padded."""
    total = 0
    for numel, dim0 in params:
        if numel == 0:
            continue
        dim0 = max(dim0, 1)
        total += -(-dim0 // num_processes) * (numel // dim0)
    return total


def estimate(sizes: ModelSizes, dtype: str, num_processes: int) -> dict[str, dict[str, int]]:
    """Bytes per process, ``{strategy: {column: bytes}}``; loading-only dtypes give one ``"load"`` row."""
    if dtype not in BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be at least 1")
    b = BYTES[dtype]
    buffers = sizes.float_buffers * b + sizes.other_buffer_bytes
    total_params, trainable = sizes.num_parameters, sizes.num_trainable
    if dtype not in TRAINABLE_DTYPES:
        load = _ceil(total_params * b + buffers)
        return {"load": {"parameters": load, "gradients": 0, "optimizer": 0, "gathered_layer": 0, "total": load}}
    state = 8.0 if dtype == "float32" else 12.0
    n = num_processes
    flat = -(-trainable // n)
    frozen = total_params - trainable
    layer = _ceil(2 * sizes.largest_layer[1] * b) if n > 1 else 0
    fsdp_params = fsdp2_shard(sizes.trainable, n) + fsdp2_shard(sizes.frozen, n)
    fsdp_trainable = fsdp2_shard(sizes.trainable, n)
    steps = 4 * len(sizes.trainable)  # Adam's fp32 step counter per parameter tensor, on every process
    rows = {
        "single": (total_params * b + buffers, trainable * b, trainable * state, 0),
        # DDP copies every gradient into its communication buckets (unless gradient_as_bucket_view=True).
        "DDP": (total_params * b + buffers, 2 * trainable * b, trainable * state, 0),
        "ZeRO-1": (total_params * b + buffers, trainable * b, flat * state, 0),
        "ZeRO-2": (total_params * b + buffers, flat * b, flat * state, 0),
        "ZeRO-3": ((flat + -(-frozen // n)) * b + buffers, flat * b, flat * state, layer),
        "FSDP2": (fsdp_params * b + buffers, fsdp_trainable * b, fsdp_trainable * state, layer),
    }
    out = {}
    for name, (params, grads, optim, gathered) in rows.items():
        cols = [_ceil(params), _ceil(grads), _ceil(optim) + steps, gathered]
        out[name] = dict(zip(COLUMNS, cols + [sum(cols)]))
    return out


def estimate_all(sizes: ModelSizes, dtypes: list[str], num_processes: int) -> dict[str, Any]:
    """Everything ``--json`` prints: the model's sizes, the assumptions and the bytes per dtype."""
    return {
        "model": sizes.name,
        "parameters": sizes.num_parameters,
        "trainable_parameters": sizes.num_trainable,
        "num_processes": num_processes,
        "largest_layer": {"name": sizes.largest_layer[0], "parameters": sizes.largest_layer[1],
                          "rule": sizes.layer_rule},
        "assumptions": list(ASSUMPTIONS),
        "bytes_per_process": {d: estimate(sizes, d, num_processes) for d in dtypes},
    }


def human_bytes(n: float) -> str:
    """``1.50 GiB``-style sizes (powers of 1024)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"  # pragma: no cover


def human_count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def render(report: dict[str, Any]) -> str:
    """The readable table of ``estimate_all``'s result."""
    layer = report["largest_layer"]
    lines = [
        f"Training memory per process for {report['model']}: {human_count(report['parameters'])} parameters "
        f"({human_count(report['trainable_parameters'])} trainable), N = {report['num_processes']} processes",
        f"Largest layer: {layer['name'] or '(none)'} ({human_count(layer['parameters'])} parameters; {layer['rule']})",
        "",
    ]
    header = ("dtype", "strategy", "parameters", "gradients", "optimizer", "gathered layer", "total")
    rows = []
    for dtype, strategies in report["bytes_per_process"].items():
        for i, (strategy, cols) in enumerate(strategies.items()):
            cells = [human_bytes(cols[c]) if (cols[c] or c in ("parameters", "total")) else "-" for c in COLUMNS]
            rows.append((dtype if i == 0 else "", strategy, *cells))
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines.append(fmt.format(*header))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt.format(*r) for r in rows)
    lines.append("")
    lines.extend(f"* {a}" for a in report["assumptions"])
    return "\n".join(lines)
