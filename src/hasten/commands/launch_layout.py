"""The N-D layout (``--parallelism_config_*``) checked against the job before any process starts.

The processes check the same layout (``utils.parallelism_config.ParallelismConfig``), but there every
rank raises its own traceback after the start-up; a layout that cannot fit the job is known here
already, so ``hasten launch`` refuses it in one line (exit 2). Torch-free: ``hasten launch`` imports
torch only when it starts processes.

Only what the launch settings decide is checked: the sizes, the process count and the device. Whether
FSDP is on (dp_shard/cp need it) can also come from the script's own ``fsdp_plugin``, so the ranks
keep that check.
"""

from __future__ import annotations

from typing import Optional

from .errors import HastenCLIError
from .launch_settings import Resolved

# The order the ranks multiply them in (row-major mesh: dp_replicate, dp_shard, cp, tp).
SIZES = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")


def _flag(size: str) -> str:
    return f"--parallelism_config_{size}"


def check_layout(res: Resolved, procs: int, device: str) -> None:
    """Raise ``HastenCLIError`` when the parallelism sizes cannot run ``procs`` processes on ``device``.

    Mirrors the ranks' rules: nothing asked (no size given, or all 1) fits any job; otherwise the
    product of the sizes is the number of processes; cp_size > 1 needs CUDA; sp_size must stay 1;
    tp/cp with replication need dp_shard (FSDP2), not dp_replicate alone.
    """
    given = {s: res[f"parallelism_config_{s}"] for s in SIZES + ("sp_size",)}
    if all(v is None for v in given.values()):
        return
    sizes = {s: 1 if v is None else int(v) for s, v in given.items()}

    def shown(size: str) -> str:
        value = res.values[f"parallelism_config_{size}"]
        where = f" ({value.source})" if value.value is not None else ""
        return f"{size} {sizes[size]}{where}"

    if sizes["sp_size"] > 1:
        raise HastenCLIError(f"{shown('sp_size')}: DeepSpeed sequence parallelism is not available in hasten; "
                             f"drop {_flag('sp_size')} (or set it to 1) and use {_flag('cp_size')} on GPUs")
    total = 1
    for s in SIZES:
        total *= sizes[s]
    if total > 1 and total != procs:
        product = " x ".join(shown(s) for s in SIZES if sizes[s] > 1)
        count = res.values["num_processes"]
        raise HastenCLIError(
            f"parallelism sizes {product} = {total} processes, but the job runs {procs}: num_processes {procs} "
            f"({count.source}); make the product of the sizes {procs}, or pass --num_processes {total}")
    problem = _cp_problem(sizes, device, shown) or _replicate_problem(sizes, shown)
    if problem:
        raise HastenCLIError(problem)


def _cp_problem(sizes: dict[str, int], device: str, shown) -> Optional[str]:
    if sizes["cp_size"] == 1 or device == "cuda":
        return None
    return (f"{shown('cp_size')} needs GPUs (context parallelism runs attention with CUDA kernels), but this "
            f"job runs on {device.upper()}; use {_flag('cp_size')} 1 and give those processes to "
            f"{_flag('dp_shard_size')} {sizes['dp_shard_size'] * sizes['cp_size']} (with --use_fsdp)")


def _replicate_problem(sizes: dict[str, int], shown) -> Optional[str]:
    if not ((sizes["tp_size"] > 1 or sizes["cp_size"] > 1) and sizes["dp_replicate_size"] > 1
            and sizes["dp_shard_size"] == 1):
        return None
    other = shown("tp_size") if sizes["tp_size"] > 1 else shown("cp_size")
    return (f"{shown('dp_replicate_size')} with {other} and dp_shard_size 1: tensor/context parallelism composes "
            f"with FSDP2, not with plain replication; pass {_flag('dp_shard_size')} {sizes['dp_replicate_size']} "
            f"and {_flag('dp_replicate_size')} 1 (with --use_fsdp)")
