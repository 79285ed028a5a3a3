"""The N-D layout (``--parallelism_config_*``) checked against the job before any process starts.

The processes check the same layout (``utils.parallelism_config.ParallelismConfig``), but there every
rank raises its own traceback after the start-up; a layout that cannot fit the job is known here
already, so ``hasten launch`` refuses it in one line (exit 2). The rules are not written twice: the
product, composition and device rules are ``hasten.layout.Layout``'s, the pipeline's are
``utils.parallelism_config.check_pipeline``; only the wording differs (``_LaunchSpelling`` names each
size with where it came from and asks for the launcher's flags). Torch-free: ``hasten launch`` imports
torch only when it starts processes.

Only what the launch settings decide is checked: the sizes, the process count and the device. Whether
FSDP is on (dp_shard/cp need it) can also come from the script's own ``fsdp_plugin``, so the ranks
keep that check.
"""

from __future__ import annotations

from ..layout import SIZED_AXES, Layout, Spelling
from ..utils.parallelism_config import check_pipeline, split_points
from .errors import HastenCLIError
from .launch_settings import Resolved

SIZES = tuple(f"{axis}_size" for axis in SIZED_AXES)  # mesh order (pp, dp_replicate, dp_shard, cp, sp, tp), then ep
PIPELINE = ("pp_schedule", "pp_microbatches", "pp_stages_per_rank", "pp_split_points")


def _flag(name: str) -> str:
    return f"--parallelism_config_{name}"


class _LaunchSpelling(Spelling):
    prefix = "parallelism sizes "
    fsdp = "--use_fsdp"
    only_enabled = True

    def __init__(self, res: Resolved, procs: int) -> None:
        self.res, self.procs = res, procs

    def size(self, axis: str, value: int) -> str:
        setting = self.res.values.get(f"parallelism_config_{axis}_size")
        where = f" ({setting.source})" if setting is not None and setting.value is not None else ""
        return f"{axis}_size {value}{where}"

    def use(self, axis: str, value: int) -> str:
        return f"{_flag(axis + '_size')} {value}"

    def job(self, world_size: int) -> str:
        return f"{world_size}: num_processes {world_size} ({self.res.values['num_processes'].source})"

    def processes(self, count: int) -> str:
        return f"pass --num_processes {count}"


def check_layout(res: Resolved, procs: int, device: str) -> None:
    """Raise ``HastenCLIError`` when the parallelism settings cannot run ``procs`` processes on ``device``.

    The ranks' rules: nothing asked (no size given, or all 1) fits any job; otherwise the product of
    the sizes is the number of processes; cp_size > 1 runs on CUDA or the CPU; cp and sp exclude each
    other, sp composes with data parallelism only; tp/cp with
    replication need dp_shard (FSDP2); the pipeline's schedule, microbatches and split points.
    """
    given = {s: res[f"parallelism_config_{s}"] for s in SIZES}
    pipeline = {p: res[f"parallelism_config_{p}"] for p in PIPELINE}
    if all(v is None for v in given.values()) and all(v is None for v in pipeline.values()):
        return
    sizes = {s: 1 if v is None else int(v) for s, v in given.items()}
    spelling = _LaunchSpelling(res, procs)
    try:
        layout = Layout.asked({s[:-len("_size")]: sizes[s] for s in SIZES}, procs)
        if layout is not None:
            layout.check(spelling, device)
        check_pipeline(sizes["pp_size"], pipeline["pp_schedule"], pipeline["pp_microbatches"],
                       pipeline["pp_stages_per_rank"], split_points(pipeline["pp_split_points"]))
    except ValueError as error:
        text = str(error).replace("ParallelismConfig: ", "", 1)
        if text.startswith(spelling.prefix):
            raise HastenCLIError(text) from None
        sources = [f"{name} ({res.values[f'parallelism_config_{name}'].source})" for name in ("pp_size",) + PIPELINE
                   if res[f"parallelism_config_{name}"] is not None]
        raise HastenCLIError(f"{text} [{', '.join(sources)}]" if sources else text) from None
