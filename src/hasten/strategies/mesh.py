"""The process layout a strategy trains on: named dimensions and the data-parallel view of them.

Processes are laid out row-major over ``(pp, dp_replicate, dp_shard, cp, tp)``: the ranks of one
tensor-parallel (and context-parallel) group are consecutive, so they sit on one machine, and the
pipeline dimension is outermost, so its point-to-point traffic is what crosses machines. Every
process of one data-parallel replica (same ``dp_replicate`` and ``dp_shard`` coordinates, any
pipeline stage) must see the same batch; the data layer is given ``ParallelMesh.data_parallel()`` instead of the global rank and
world size, and gathers metrics over the data-parallel group only.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Optional

from ..layout import AXES, DATA_AXES, Layout, Spelling
from ..topology import DataParallel

DIMS = AXES  # the mesh order, outermost first (hasten.layout)
# The axes whose processes hold different tokens of a step: the data axes and the sequence-splitting ones.
TOKEN_AXES = tuple(a for a in DIMS if a in DATA_AXES or a in ("cp", "sp"))
# Joint dimensions of the torch mesh (Accelerate's names) -> the dimensions they flatten.
# ``dp_shard_sp`` is hasten's: what FSDP2 shards over with sequence parallelism (sp processes hold the same weights).
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp"), "dp_shard_sp": ("dp_shard", "sp")}
# Joint dimensions that are not Accelerate's: made only when the axis they exist for is enabled.
ONLY_WITH = {"dp_shard_sp": "sp"}


class _MeshSpelling(Spelling):
    prefix = "the parallel layout "


def check_layout(sizes: dict[str, int], world_size: int) -> None:
    """Raise before any process-group work when ``sizes`` cannot lay out ``world_size`` processes
    (``hasten.layout.Layout``'s product rule)."""
    problem = Layout.from_sizes(sizes, world_size).mismatch(_MeshSpelling())
    if problem:
        raise ValueError(problem)


def mesh_names_and_shape(sizes: dict[str, int], keep: tuple[str, ...] = ()) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The torch mesh's dimension names and sizes: those of ``DIMS`` larger than 1 (or kept), in ``DIMS`` order."""
    return Layout.from_sizes({n: sizes.get(n, 1) for n in DIMS}, _product(sizes)).mesh_names_and_shape(keep)


def _product(sizes: dict[str, int]) -> int:
    total = 1
    for name in DIMS:
        total *= sizes.get(name, 1)
    return total


def flatten_joint(mesh: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """Flatten the joint dimensions (``FLATTENED``) of ``mesh`` whose parts are enabled; return them by name.

    Collective: every process flattens the same dimensions in the same order (each makes a group).
    The parts go to the mesh as a list, the type ``ParallelismConfig.dp_dim_names`` has (Accelerate's)."""
    flattened = {}
    for joint, parts in FLATTENED.items():
        enabled = [n for n in parts if sizes.get(n, 1) > 1]
        if joint in ONLY_WITH and sizes.get(ONLY_WITH[joint], 1) == 1:
            continue
        if enabled:
            flattened[joint] = mesh[enabled]._flatten(joint)
    return flattened


class ParallelMesh:
    """Named dimensions over the job's processes; the strategy that trains on them owns it.

    Args:
        sizes: size per dimension name of ``DIMS`` (missing names are 1).
        rank / world_size: this process and the job's number of processes.
        device_type: "cpu", "cuda", ... (the torch ``DeviceMesh`` is built on it when asked for).
        keep: dimensions the torch mesh holds even at size 1 (FSDP2's shard dimension).
        ep: processes the routed experts are split over, borrowed from ``dp_shard x cp x sp x tp`` (``expert_mesh``).
    """

    def __init__(self, sizes: dict[str, int], rank: int, world_size: int, device_type: str = "cpu",
                 keep: tuple[str, ...] = (), ep: int = 1) -> None:
        unknown = sorted(set(sizes) - set(DIMS))
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {unknown}; use {list(DIMS)}")
        self.sizes = {name: int(sizes.get(name, 1)) for name in DIMS}
        check_layout(self.sizes, world_size)
        problem = Layout.from_sizes({**self.sizes, "ep": ep}, world_size).expert_problem(_MeshSpelling())
        if problem:
            raise ValueError(problem)
        self.rank, self.world_size, self.device_type = rank, world_size, device_type
        self.keep = tuple(keep)
        self.ep = ep
        self._device_mesh: Any = None
        self._expert_mesh: Any = None
        self._flattened: dict[str, Any] = {}
        self._data_parallel: Optional[DataParallel] = None
        self._token_parallel: Optional[DataParallel] = None

    @classmethod
    def replicated(cls, state: Any) -> "ParallelMesh":
        """Every process a full replica (single process, DDP)."""
        return cls({"dp_replicate": state.num_processes}, state.process_index, state.num_processes, state.device.type)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.sizes)

    def coordinates(self, rank: Optional[int] = None) -> dict[str, int]:
        rank = self.rank if rank is None else rank
        out = {}
        for name in reversed(DIMS):
            rank, out[name] = divmod(rank, self.sizes[name])
        return {name: out[name] for name in DIMS}

    @property
    def dp_size(self) -> int:
        return self.sizes["dp_replicate"] * self.sizes["dp_shard"]

    def data_parallel(self) -> DataParallel:
        """Data-parallel rank, size and group (the group is created once, by every process)."""
        if self._data_parallel is None:
            # The processes that read different batches: those differing only in the data axes.
            self._data_parallel = self._build_group([a for a in DIMS if a in DATA_AXES])
        return self._data_parallel

    def _build_group(self, data: list[str]) -> DataParallel:
        """Rank, size and group of the processes differing only in the axes ``data``; one group per
        position on the other axes (the whole job, with no group made, when those are all 1)."""
        coords = self.coordinates()
        others = [a for a in DIMS if a not in data]
        dp_rank = _row_major({a: coords[a] for a in data}, {a: self.sizes[a] for a in data})
        size = 1
        for a in data:
            size *= self.sizes[a]
        if all(self.sizes[a] == 1 for a in others):
            return DataParallel(dp_rank, size)
        import torch.distributed as dist

        strides = _strides(self.sizes)
        # Every process must create all of the groups, in the same order.
        mine = None
        for position in itertools.product(*(range(self.sizes[a]) for a in others)):
            base = sum(strides[a] * c for a, c in zip(others, position))
            ranks = [base + sum(strides[a] * c for a, c in zip(data, point))
                     for point in itertools.product(*(range(self.sizes[a]) for a in data))]
            group = dist.new_group(ranks=ranks)
            if self.rank in ranks:
                mine = (group, tuple(ranks))
        return DataParallel(dp_rank, size, mine[0], mine[1])

    def device_mesh(self) -> Any:
        """The torch ``DeviceMesh`` over the dimensions larger than 1 (built once, collectively).

        As Accelerate's, it also holds the joint dimensions flattened from the enabled ones
        (``FLATTENED``): ``dp`` (data parallel), ``dp_shard_cp`` (what FSDP2 shards over) and
        ``dp_cp`` (what the loss is averaged over), each only when one of its parts is larger than 1.
        """
        if self._device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            names, shape = mesh_names_and_shape(self.sizes, self.keep)
            mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=names)
            self._flattened = flatten_joint(mesh, self.sizes)
            self._device_mesh = mesh
        return self._device_mesh

    def expert_mesh(self) -> Any:
        """The experts' torch ``DeviceMesh`` (built once, collectively): the same processes as the mesh,
        with one model copy's ``dp_shard x cp x sp x tp`` block (consecutive ranks, row-major) split into
        ``efsdp`` (outer: the processes holding the same experts, which FSDP2 shards them over) and ``ep``
        (inner: the processes the experts are split over and tokens travel between), beside ``pp`` (each
        pipeline stage's processes exchange tokens among themselves), ``dp_replicate`` and ``etp`` (size 1:
        the experts are not split by tensor parallelism; ``same_tokens_mesh`` is what tp processes share).
        The dense and the expert mesh are two torch meshes: the experts' parameters and their FSDP2 mesh are
        slices of this one."""
        if self._expert_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            block = Layout.from_sizes({**self.sizes, "ep": self.ep}, self.world_size).expert_block
            names = ("pp", "dp_replicate", "efsdp", "ep", "etp")
            shape = (self.sizes["pp"], self.sizes["dp_replicate"], block // self.ep, self.ep, 1)
            self._expert_mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=names)
        return self._expert_mesh

    def same_tokens_mesh(self) -> Any:
        """The processes holding the same tokens (the ``tp`` processes, a size-1 mesh without tensor
        parallelism): before the experts they take disjoint slices of those tokens, so that each token is
        sent to its experts once (transformers' ``AllToAllEP``)."""
        return self["tp"] if self.sizes["tp"] > 1 else self.expert_mesh()["etp"]

    def token_parallel(self) -> DataParallel:
        """Rank, size and group of the processes holding different tokens of one step: the data axes and
        the sequence-splitting ones (``cp``, ``sp``); one group per position on ``pp`` and ``tp``. What a
        whole-batch statistic (the router's load-balancing loss) sums over, and what the gradients of
        parameters that see those tokens are averaged over."""
        if self._token_parallel is None:
            self._token_parallel = self._build_group(list(TOKEN_AXES))
        return self._token_parallel

    @property
    def token_size(self) -> int:
        """``token_parallel().size``, without making its groups (not collective)."""
        return math.prod(self.sizes[a] for a in TOKEN_AXES)

    def __getitem__(self, names: Any) -> Any:
        """The torch sub-mesh of ``names`` (e.g. ``mesh["tp"]``, ``mesh[("dp_replicate", "dp_shard")]``,
        or a flattened dimension such as ``mesh["dp_shard_cp"]``)."""
        mesh = self.device_mesh()
        if isinstance(names, str) and names in self._flattened:
            return self._flattened[names]  # kept: slicing a flattened dimension from the root is deprecated
        return mesh[names]

    def __repr__(self) -> str:
        borrowed = f", ep={self.ep}" if self.ep > 1 else ""
        return "ParallelMesh(" + ", ".join(f"{n}={s}" for n, s in self.sizes.items()) + borrowed + ")"


def _strides(sizes: dict[str, int]) -> dict[str, int]:
    """How far apart two ranks one step apart on each axis are (row-major over ``DIMS``)."""
    out, step = {}, 1
    for name in reversed(DIMS):
        out[name] = step
        step *= sizes[name]
    return out


def _row_major(coords: dict[str, int], sizes: dict[str, int]) -> int:
    """The index of ``coords`` among the points of the axes of ``sizes``, the first axis outermost."""
    index = 0
    for name, coord in coords.items():
        index = index * sizes[name] + coord
    return index

