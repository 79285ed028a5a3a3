"""``ParallelismConfig``: the N-D process layout (Accelerate's names), checked before any process starts talking.

Fields left as None are read from the ``PARALLELISM_CONFIG_*`` environment that ``hasten launch
--parallelism_config_*`` (and ``accelerate launch``) set from the ``parallelism_config:`` section
or the flags. Torch-free: the layout is checked against the job's size before the process group
exists, so a wrong layout fails with a message naming the sizes instead of hanging a collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from ..layout import AXES, SIZED_AXES, Layout

_SIZES = tuple(f"{axis}_size" for axis in SIZED_AXES)  # one field per axis of hasten.layout (ep included)
# The pipeline schedules of torch.distributed.pipelining (its own names; tests/test_pipeline_config.py checks
# this list against torch's registry, so the config stays torch-free and still names what torch has).
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Schedules that run several stages on each process (``pp_stages_per_rank`` > 1; V-shaped ones exactly 2).
PP_MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
PP_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# "hasten": hasten's own Ulysses all-to-all; "deepspeed": Accelerate's name for DeepSpeed's (with DeepSpeed only).
SP_BACKENDS = ("hasten", "deepspeed")


def _did_you_mean(value: str, choices: tuple) -> str:
    import difflib

    close = difflib.get_close_matches(value.lower(), [c.lower() for c in choices], n=1, cutoff=0.5)
    if not close:
        return ""
    return f" (did you mean {next(c for c in choices if c.lower() == close[0])!r}?)"


def pp_schedule_name(value: Any) -> str:
    """The schedule's name as torch spells it; ``ValueError`` naming the choices otherwise."""
    if isinstance(value, str):
        for name in PP_SCHEDULES:
            if name.lower() == value.strip().lower():
                return name
    raise ValueError(f"ParallelismConfig: pp_schedule={value!r} is not a pipeline schedule"
                     f"{_did_you_mean(str(value), PP_SCHEDULES)}; use one of {', '.join(PP_SCHEDULES)}")


def _size(name: str, value: Any) -> int:
    if value is None:
        value = os.environ.get("PARALLELISM_CONFIG_" + name.upper(), "1")
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"ParallelismConfig: {name}={value!r} must be a whole number >= 1")
    return number


def split_points(value: Any) -> Any:
    """``"a, b"`` (the launcher's and the environment's spelling) -> ``["a", "b"]``; other values as given."""
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    return value


def check_pipeline(pp_size: int, schedule: Any = None, microbatches: Any = None, stages_per_rank: Any = None,
                   points: Any = None) -> tuple[str, int, int, Optional[list[str]]]:
    """The pipeline's rules, in one place (``ParallelismConfig`` and ``hasten launch`` call it): returns
    ``(schedule, microbatches, stages_per_rank, split_points)`` with the defaults filled in, or raises
    ``ValueError`` naming the value. ``points`` may be a comma-separated string (the launcher's form)."""
    schedule = pp_schedule_name(schedule or "1F1B")
    stages_per_rank = _size("pp_stages_per_rank", stages_per_rank or (2 if schedule in PP_MULTI_STAGE else 1))
    if schedule in PP_V_SHAPED and stages_per_rank != 2:
        raise ValueError(f"ParallelismConfig: pp_schedule={schedule!r} runs exactly 2 stages per process "
                         f"(a V shape), not pp_stages_per_rank={stages_per_rank}; set it to 2")
    if schedule not in PP_MULTI_STAGE and stages_per_rank != 1:
        raise ValueError(f"ParallelismConfig: pp_schedule={schedule!r} runs one stage per process, not "
                         f"pp_stages_per_rank={stages_per_rank}; use 'Interleaved1F1B' for several")
    stages = pp_size * stages_per_rank
    microbatches = _size("pp_microbatches", microbatches) if microbatches else stages
    if pp_size > 1 and microbatches < stages:
        raise ValueError(f"ParallelismConfig: pp_microbatches={microbatches} is fewer than the {stages} pipeline "
                         f"stages (pp_size={pp_size} x pp_stages_per_rank={stages_per_rank}): the pipeline could "
                         f"never be full; use pp_microbatches >= {stages} (more keeps the bubble smaller)")
    if points is not None:
        if isinstance(points, str) or not all(isinstance(p, str) and p for p in points):
            raise ValueError(f"ParallelismConfig: pp_split_points={points!r} must be a list of module names "
                             "(each begins a new stage), e.g. ['model.layers.4']")
        points = list(points)
        if pp_size > 1 and len(points) != stages - 1:
            raise ValueError(f"ParallelismConfig: pp_split_points has {len(points)} names, but pp_size={pp_size} x "
                             f"pp_stages_per_rank={stages_per_rank} = {stages} stages need {stages - 1}")
    return schedule, microbatches, stages_per_rank, points


@dataclass
class ParallelismConfig:
    """How the processes of a job are laid out: data parallel (replicated and sharded), context and tensor parallel.

    Args (Accelerate's names; each defaults to ``PARALLELISM_CONFIG_<NAME>``, else 1):
        dp_replicate_size: full copies of the (sharded) model; with ``dp_shard_size`` > 1 this is HSDP, with
            ``dp_shard_size`` = 1 under FSDP every process holds the full parameters (replication).
        dp_shard_size: processes one copy is sharded over with FSDP2 (needs ``fsdp_plugin``/``--use_fsdp``).
        tp_size: processes one layer's weights are split over (tensor parallelism, DTensor).
        cp_size: processes one sequence is split over (context parallelism; needs a GPU).
        cp_backend: "torch" (the only one).
        sp_size: processes one sequence is split over with Ulysses sequence parallelism (all-to-all over the
            attention heads; ``hasten/strategies/sequence_parallel.py``). A mesh axis, counted in ``total_size``
            as in Accelerate; excludes ``cp_size``.
        sp_backend: "hasten" (the default: hasten's own all-to-all, with one process, DDP or FSDP2) or
            "deepspeed" (Accelerate's default: DeepSpeed's Ulysses, with a ``deepspeed_plugin``; under DeepSpeed
            sp runs DeepSpeed's Ulysses whichever is named, see ``docs/sharded.md``).
        ep_size: processes the routed experts of a mixture-of-experts model are split over (expert
            parallelism). It borrows processes of one model copy (it must divide ``dp_shard_size x cp_size x
            sp_size x tp_size``, or the number of processes when no other size is given) and needs FSDP2; it
            is no factor of the product rule.
        ep_plan: hasten's addition: ``{module name or pattern: "experts"}`` naming the experts modules to
            split, used instead of the model's own plan (transformers' ``base_model_ep_plan``); see
            ``hasten.strategies.expert_parallel``.
        tp_plan: hasten's addition: a ``parallelize_module`` plan, ``{module name or pattern:
            ParallelStyle or "colwise"/"rowwise"/...}``, used instead of the model's own plan
            (transformers' ``base_model_tp_plan``).

    The product of the sizes must equal the number of processes (``hasten.layout.Layout`` holds that
    rule). Processes are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp): the
    tensor-parallel ranks of one replica are consecutive (one machine) and receive the same batches.
    """

    dp_replicate_size: Optional[int] = None
    dp_shard_size: Optional[int] = None
    tp_size: Optional[int] = None
    cp_size: Optional[int] = None
    cp_backend: Optional[str] = None
    sp_size: Optional[int] = None
    sp_backend: Optional[str] = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None
    tp_plan: Optional[dict[str, Any]] = field(default=None, repr=False)
    ep_size: Optional[int] = None
    ep_plan: Optional[dict[str, Any]] = field(default=None, repr=False)
    pp_size: Optional[int] = None
    pp_schedule: Optional[str] = None
    pp_microbatches: Optional[int] = None
    pp_stages_per_rank: Optional[int] = None
    pp_split_points: Optional[list[str]] = None

    def __post_init__(self) -> None:
        for name in _SIZES:
            setattr(self, name, _size(name, getattr(self, name)))
        self.cp_backend = self.cp_backend or os.environ.get("PARALLELISM_CONFIG_CP_BACKEND", "torch")
        if self.cp_backend != "torch":
            raise ValueError(f"ParallelismConfig: cp_backend={self.cp_backend!r}; use 'torch'")
        self.sp_backend = self.sp_backend or os.environ.get("PARALLELISM_CONFIG_SP_BACKEND") or "hasten"
        if self.sp_backend not in SP_BACKENDS:
            raise ValueError(f"ParallelismConfig: sp_backend={self.sp_backend!r}; use one of {list(SP_BACKENDS)}")
        layout = self.layout(self.total_size)  # its rules: hasten.layout
        problem = layout.composition_problem() or layout.sequence_problem()
        if problem:
            raise ValueError(problem)
        if self.cp_size > 1 and self.cp_handler is None:  # as Accelerate: the handler holds the environment's choice
            from .parallel_configs import TorchContextParallelConfig

            self.cp_handler = TorchContextParallelConfig()
        self._pipeline_fields()
        if self.tp_plan is not None and not isinstance(self.tp_plan, dict):
            raise TypeError(f"ParallelismConfig: tp_plan must be a dict {{module name: style}}, got "
                            f"{type(self.tp_plan).__name__}")
        if self.ep_plan is not None and not isinstance(self.ep_plan, dict):
            raise TypeError(f"ParallelismConfig: ep_plan must be a dict {{module name: 'experts'}}, got "
                            f"{type(self.ep_plan).__name__}")

    def _pipeline_fields(self) -> None:
        """The pipeline's schedule, microbatches, stages per process and split points, each from the
        ``PARALLELISM_CONFIG_PP_*`` environment when not given, checked before any process talks."""
        env = os.environ.get
        points = self.pp_split_points
        if points is None and env("PARALLELISM_CONFIG_PP_SPLIT_POINTS"):
            points = split_points(env("PARALLELISM_CONFIG_PP_SPLIT_POINTS", ""))
        (self.pp_schedule, self.pp_microbatches, self.pp_stages_per_rank, self.pp_split_points) = check_pipeline(
            self.pp_size, self.pp_schedule or env("PARALLELISM_CONFIG_PP_SCHEDULE"),
            self.pp_microbatches or env("PARALLELISM_CONFIG_PP_MICROBATCHES"),
            self.pp_stages_per_rank or env("PARALLELISM_CONFIG_PP_STAGES_PER_RANK"), points)

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: ``pp_size`` processes x ``pp_stages_per_rank`` each."""
        return self.pp_size * self.pp_stages_per_rank

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    # -- views ------------------------------------------------------------------------------------
    @property
    def total_size(self) -> int:
        """The product of the mesh axes' sizes (Accelerate's, which counts sp too; hasten's pp as well; not ep,
        which borrows processes)."""
        total = 1
        for size in self.sizes().values():
            total *= size
        return total

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size * self.pp_size

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep_size > 1

    def sizes(self) -> dict[str, int]:
        """Size per mesh dimension name (``strategies.mesh.DIMS``); ``ep_size`` borrows, so it is not one."""
        return {axis: getattr(self, f"{axis}_size") for axis in AXES}

    def all_sizes(self) -> dict[str, int]:
        """Size per axis of ``hasten.layout.AXIS_TABLE``: the mesh's and the borrowed ones (``ep``)."""
        return {axis: getattr(self, f"{axis}_size") for axis in SIZED_AXES}

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SIZES + ("cp_backend", "sp_backend", "pp_schedule",
                                                               "pp_microbatches", "pp_stages_per_rank",
                                                               "pp_split_points")}

    # Accelerate's names of the enabled dimensions (lists, as Accelerate's), in mesh order.
    @property
    def dp_dim_names(self) -> list[str]:
        """The enabled data-parallel dimensions (flattened into ``dp``)."""
        return [n for n in ("dp_replicate", "dp_shard") if self.sizes()[n] > 1]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The enabled dimensions whose processes receive the same batch."""
        return [n for n in ("tp", "cp", "sp") if self.sizes()[n] > 1]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The enabled dimensions FSDP2 shards the model over (flattened into ``dp_shard_cp``)."""
        return [n for n in ("dp_shard", "cp") if self.sizes()[n] > 1]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The enabled dimensions the loss is averaged over (flattened into ``dp_cp``)."""
        return [n for n in ("dp_replicate", "dp_shard", "cp") if self.sizes()[n] > 1]

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The dimensions FSDP2 is applied over, replication included."""
        return ["dp_replicate"] * self.dp_replicate_enabled + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    def _get_mesh(self) -> tuple:
        """``(dimension names, sizes)`` of the torch mesh (the enabled dimensions, in mesh order), or ``()``
        when none is enabled. Accelerate's private helper, which its tests call."""
        from ..strategies.mesh import mesh_names_and_shape

        if self.total_size == 1:
            return ()
        return mesh_names_and_shape(self.sizes())

    def build_device_mesh(self, device_type: str) -> Any:
        """The torch ``DeviceMesh`` of this layout on ``device_type`` ("cuda", "cpu", ...), with the joint
        dimensions ``dp``, ``dp_shard_cp`` and ``dp_cp`` flattened as Accelerate's; ``None`` when every
        size is 1. Collective: every process of the job calls it.

        The layout is checked against the job's size before any group is made: the process group's
        size once it exists, else the launcher's ``WORLD_SIZE`` (the size torch's rendezvous will
        use). A process that no launcher started has no size to check against yet: torch's
        ``init_device_mesh`` is called as in Accelerate, and its refusal is raised naming the layout."""
        if self.total_size == 1:
            return None
        import torch.distributed as dist

        from ..strategies.mesh import ParallelMesh, check_layout, flatten_joint

        if dist.is_available() and dist.is_initialized():
            return ParallelMesh(self.sizes(), dist.get_rank(), dist.get_world_size(), device_type).device_mesh()
        launched = os.environ.get("WORLD_SIZE")
        if launched:
            check_layout(self.sizes(), int(launched))
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = self._get_mesh()
        try:
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        except (ValueError, RuntimeError) as error:
            if launched:
                raise
            raise ValueError(
                f"ParallelismConfig: {self._shown()} = {self.total_size} processes, but this process runs alone (no "
                f"process group, no WORLD_SIZE from a launcher); start it with hasten launch --num_processes "
                f"{self.total_size} (torch: {error})") from error
        if dist.is_available() and dist.is_initialized():  # torch made the group: its size is the job's
            check_layout(self.sizes(), dist.get_world_size())
        flatten_joint(mesh, self.sizes())
        return mesh

    def _shown(self) -> str:
        return self.layout(self.total_size).shown()

    def layout(self, world_size: int) -> Any:
        """This layout's sizes on a job of ``world_size`` processes (``hasten.layout.Layout``, torch-free)."""
        return Layout.from_config(self, world_size)

    # -- checks before the process group ----------------------------------------------------------
    def check(self, world_size: int, sharded: bool, device_type: str, deepspeed: bool = False) -> None:
        """Raise when this layout cannot run ``world_size`` processes (``sharded``: FSDP2 is on;
        ``deepspeed``: DeepSpeed's engine is)."""
        if self.sp_size > 1 and self.sp_backend == "deepspeed" and not deepspeed:
            raise ValueError(f"ParallelismConfig: sp_size={self.sp_size} with sp_backend='deepspeed' runs DeepSpeed's "
                             "Ulysses attention, which needs DeepSpeed's engine: pass a deepspeed_plugin (or hasten "
                             "launch --use_deepspeed), or use sp_backend='hasten' (hasten's own all-to-all) with DDP or "
                             "FSDP2")
        # Under DeepSpeed, sp always runs DeepSpeed's Ulysses (strategies/deepspeed_ulysses.py): its engine
        # reduces gradients over its own sp groups (mpu), which hasten's all-to-all does not give it.
        layout = Layout.asked(self.all_sizes(), world_size)
        if layout is None:
            return  # nothing asked: the strategy's default layout (DDP replicas or FSDP2 over all)
        layout.check(device_type=device_type)  # the product, composition, expert and device rules (hasten.layout)
        if self.ep_size > 1 and not sharded:
            raise ValueError(f"ParallelismConfig: ep_size={self.ep_size} splits the experts over processes of one "
                             "model copy, and FSDP2 shards them over the processes holding the same ones; turn it on "
                             "with fsdp_plugin=FullyShardedDataParallelPlugin() or hasten launch --use_fsdp")
        if self.cp_size > 1 and not sharded:
            raise ValueError(f"ParallelismConfig: cp_size={self.cp_size} shards the model over dp_shard x cp with "
                             "FSDP2; turn it on with fsdp_plugin=FullyShardedDataParallelPlugin() or hasten launch "
                             "--use_fsdp")
        if self.cp_size > 1:
            from ..strategies.context_parallel import comm_strategy

            comm_strategy(self.cp_handler)  # a wrong value named now, not at the first step
        if self.dp_shard_size > 1 and not sharded:
            raise ValueError(f"ParallelismConfig: dp_shard_size={self.dp_shard_size} shards the model with FSDP2; "
                             "turn it on with fsdp_plugin=FullyShardedDataParallelPlugin() or hasten launch "
                             "--use_fsdp, or use dp_replicate_size for plain data parallelism")
        # FSDP with dp_shard_size=1 is accepted, as in Accelerate: FSDP2 over a shard dimension of one
        # process (with tp alone, or on a one-process job), or HSDP that replicates (dp_replicate_size > 1).


def parallelism_config_from_env() -> Optional[ParallelismConfig]:
    """The config ``hasten launch --parallelism_config_*`` asked for, if it asked."""
    from .environment import parse_flag

    if parse_flag("USE_PARALLELISM_CONFIG") or any(os.environ.get("PARALLELISM_CONFIG_" + n.upper())
                                                    for n in _SIZES):
        return ParallelismConfig()
    return None
