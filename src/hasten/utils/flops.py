"""FLOPs of one step (``measure_flops``, Lightning Fabric's name) and the peak FLOP/s of accelerators.

The peak table holds *dense* figures: vendors print tensor-core numbers "with sparsity", twice what a
dense matmul can reach, and MFU is measured against dense work. Each figure says where it comes from.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Per chip, per compute type: dense FLOP/s of one device (one GPU; one MI300X package).
# "float32" is plain FP32 (CUDA cores); "tf32" is FP32 matmuls on tensor cores, used when
# torch.backends.cuda.matmul.allow_tf32 is on (or float32_matmul_precision is not "highest").
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5 / PCIe / NVL columns); sparse figures halved.
    "h100-sxm": {"float64": 67e12, "float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12,
                 "float16": 989.5e12, "float8": 1979e12, "int8": 1979e12},
    "h100-pcie": {"float64": 51e12, "float32": 51e12, "tf32": 378e12, "bfloat16": 756.5e12,
                  "float16": 756.5e12, "float8": 1513e12, "int8": 1513e12},
    "h100-nvl": {"float64": 60e12, "float32": 60e12, "tf32": 417.5e12, "bfloat16": 835.5e12,
                 "float16": 835.5e12, "float8": 1670.5e12, "int8": 1670.5e12},
    # NVIDIA H200 Tensor Core GPU datasheet (SXM / NVL columns): the H100's compute, more memory.
    # GH200 Grace Hopper datasheet: the same Hopper GPU figures as H100/H200 SXM.
    "h200-sxm": {"float64": 67e12, "float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12,
                 "float16": 989.5e12, "float8": 1979e12, "int8": 1979e12},
    "h200-nvl": {"float64": 60e12, "float32": 60e12, "tf32": 417.5e12, "bfloat16": 835.5e12,
                 "float16": 835.5e12, "float8": 1670.5e12, "int8": 1670.5e12},
    # NVIDIA HGX B200 datasheet (8 GPUs; divided by 8), sparse figures halved.
    "b200": {"float64": 37e12, "float32": 75e12, "tf32": 1.1e15, "bfloat16": 2.25e15, "float16": 2.25e15,
             "float8": 4.5e15, "int8": 4.5e15},
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe have the same peak figures).
    "a100": {"float64": 19.5e12, "float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12,
             "int8": 624e12},
    # NVIDIA A10 Tensor Core GPU datasheet. AWS publishes no sheet for its A10G: the A10's figures are used.
    "a10": {"float32": 31.2e12, "tf32": 62.5e12, "bfloat16": 125e12, "float16": 125e12, "int8": 250e12},
    # NVIDIA L4 Tensor Core GPU datasheet; sparse figures halved.
    "l4": {"float32": 30.3e12, "tf32": 60e12, "bfloat16": 121e12, "float16": 121e12, "float8": 242.5e12,
           "int8": 242.5e12},
    # NVIDIA L40S datasheet; sparse figures halved.
    "l40s": {"float32": 91.6e12, "tf32": 183e12, "bfloat16": 362.05e12, "float16": 362.05e12,
             "float8": 733e12, "int8": 733e12},
    # NVIDIA V100 datasheet (SXM2 / PCIe / V100S PCIe); Volta has no bfloat16 or tf32.
    "v100-sxm": {"float64": 7.8e12, "float32": 15.7e12, "float16": 125e12},
    "v100-pcie": {"float64": 7e12, "float32": 14e12, "float16": 112e12},
    "v100s-pcie": {"float64": 8.2e12, "float32": 16.4e12, "float16": 130e12},
    # NVIDIA T4 datasheet (mixed-precision FP16/FP32 tensor figure).
    "t4": {"float32": 8.1e12, "float16": 65e12, "int8": 130e12},
    # AMD Instinct MI300X datasheet (dense matrix figures); the MI325X datasheet has the same compute.
    "mi300x": {"float64": 163.4e12, "float32": 163.4e12, "tf32": 653.7e12, "bfloat16": 1307.4e12,
               "float16": 1307.4e12, "float8": 2614.9e12, "int8": 2614.9e12},
    # AMD Instinct MI250X datasheet (one OAM package, both dies).
    "mi250x": {"float64": 95.7e12, "float32": 95.7e12, "bfloat16": 383e12, "float16": 383e12, "int8": 383e12},
}

# What torch.cuda.get_device_name() prints, lower-cased, to a row of PEAK_FLOPS; the first match wins,
# so the variants come before the plain names ("h100 ... nvl" before "h100", "l40s" is not "l4").
_NAME_RULES: tuple[tuple[str, str], ...] = (
    (r"\bh100\b.*\bnvl\b", "h100-nvl"), (r"\bh100\b.*\bpcie\b", "h100-pcie"), (r"\bh100\b", "h100-sxm"),
    (r"\bh200\b.*\bnvl\b", "h200-nvl"), (r"\bg?h200\b", "h200-sxm"),
    (r"\bb200\b", "b200"), (r"\ba100\b", "a100"), (r"\ba10g?\b", "a10"),
    (r"\bl40s\b", "l40s"), (r"\bl4\b", "l4"),
    (r"\bv100s\b", "v100s-pcie"), (r"\bv100\b.*\bpcie\b", "v100-pcie"), (r"\bv100\b", "v100-sxm"),
    (r"\bt4\b", "t4"), (r"\bmi3(00|25)x\b", "mi300x"), (r"\bmi250x\b", "mi250x"),
)

_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp8": "float8",
                "fp64": "float64", "double": "float64", "float": "float32"}


def chip_of(device_name: str) -> Optional[str]:
    """The row of ``PEAK_FLOPS`` for a device name such as ``"NVIDIA H100 80GB HBM3"``, or None."""
    name = device_name.lower().replace("_", " ")
    return next((chip for pattern, chip in _NAME_RULES if re.search(pattern, name)), None)


def _dtype_key(dtype: Union[str, "torch.dtype"]) -> str:
    text = str(dtype).replace("torch.", "").lower()
    if text.startswith("float8"):
        return "float8"
    return _DTYPE_NAMES.get(text, text)


def peak_flops(device_name: str, dtype: Union[str, "torch.dtype"]) -> Optional[float]:
    """Dense peak FLOP/s of one device called ``device_name`` computing in ``dtype``; None when unknown.

    ``dtype`` is a torch dtype or one of ``"float32"``, ``"tf32"``, ``"bfloat16"``, ``"float16"``,
    ``"float8"``, ``"int8"``, ``"float64"`` (``"bf16"``, ``"fp16"``, ``"fp8"`` are understood too).
    """
    chip = chip_of(device_name)
    if chip is None:
        return None
    return PEAK_FLOPS[chip].get(_dtype_key(dtype))


def compute_dtype(mixed_precision: str) -> str:
    """The matmul type of a run with ``mixed_precision`` (``"no"``: float32, or tf32 when torch allows it)."""
    if mixed_precision in ("bf16", "fp16", "fp8"):
        return _dtype_key(mixed_precision)
    import torch

    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "float32"


def get_available_flops(device: "torch.device", dtype: Union[str, "torch.dtype"]) -> Optional[float]:
    """Dense peak FLOP/s of ``device`` in ``dtype`` from ``PEAK_FLOPS``; None for CPUs and unknown chips."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":  # ROCm devices are "cuda" too; other accelerators are not in the table
        return None
    return peak_flops(torch.cuda.get_device_name(device), dtype)


def _refuse_wrapped(model: Any) -> None:
    """A DDP or FSDP model's backward talks to the other processes: measuring it on one would hang."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = isinstance(model, DistributedDataParallel)
    try:
        from torch.distributed.fsdp import FSDPModule

        wrapped = wrapped or isinstance(model, FSDPModule)
    except ImportError:  # pragma: no cover - torch without FSDP2
        pass
    if wrapped:
        raise ValueError(f"measure_flops(model={type(model).__name__}): a prepared, distributed model communicates "
                         "in backward; measure accelerator.unwrap_model(model), or better a copy built on the meta "
                         "device (with torch.device('meta'): model = MyModel(config))")


def measure_flops(model: "torch.nn.Module", forward_fn: Callable[[], Any],
                  loss_fn: Optional[Callable[[Any], "torch.Tensor"]] = None) -> int:
    """FLOPs of one call of ``forward_fn`` (and, with ``loss_fn``, of the loss and its backward), counted by
    ``torch.utils.flop_counter.FlopCounterMode``: matmuls, convolutions and attention, as run.

    Build the model and its inputs on the meta device when you can: nothing is computed and no memory is
    used, yet the count is the same. A model with real weights works too: the gradients it had before are
    put back afterwards, so measuring does not disturb training. Divide by nothing: the result is the FLOPs
    of the batch ``forward_fn`` uses, on one process; pass it to ``Throughput.update(flops_per_batch=...)``.

    Example::

        with torch.device("meta"):
            model = MyModel(config)
            batch = torch.randint(0, vocab, (batch_size, seq_len))
        flops = measure_flops(model, lambda: model(batch), lambda out: out.logits.sum())
    """
    from torch.utils.flop_counter import FlopCounterMode

    _refuse_wrapped(model)
    kept = [(p, p.grad) for p in model.parameters()]
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            out = forward_fn()
            if loss_fn is not None:
                loss_fn(out).backward()
    finally:
        for param, grad in kept:
            param.grad = grad
    return int(counter.get_total_flops())
