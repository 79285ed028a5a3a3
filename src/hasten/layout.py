"""The process layout of a job: every parallel axis, its size, and the rules that tie them together.

One torch-free object (as torchtitan's ``ParallelDims``) that ``ParallelismConfig`` (in the processes),
``strategies.mesh`` (when the torch mesh is made) and ``hasten launch`` (before any process starts) all
check a layout with, so each rule and its message exist once. Only the wording of the sizes differs by
who speaks: ``Spelling`` says ``tp_size=2`` for a Python argument, the launcher's says
``tp_size 2 (command line --parallelism_config_tp_size)`` and asks for its flags.

Mesh order (``AXES``, outermost first): ``pp, dp_replicate, dp_shard, cp, sp, tp`` (Accelerate's, with pp). Ranks are laid out row-major,
so the tensor-parallel ranks of one replica are consecutive (one machine, the most traffic) and the
pipeline axis is outermost (only point-to-point activations between neighbouring stages cross machines).

``ep`` (expert parallelism) is an axis of the table but not of the mesh order: it *borrows* processes
(``Axis.borrows``) instead of multiplying them, as torchtitan's: the routed experts are split over ``ep``
consecutive processes of one model copy's ``dp_shard x cp x sp x tp`` block, which still read their own
tokens and lay out everything else as before; so ``ep`` is no factor of the product rule. Its own rule
(``Layout.expert_problem``) is written here once: ep divides the processes it borrows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

@dataclass(frozen=True)
class Axis:
    """One parallel axis: its name (the mesh dimension; ``<name>_size`` in ``ParallelismConfig``, the
    config file and the launcher), whether its processes read different batches (``data``), and the
    launcher's help. The table below is the one place an axis is declared; the config keys, the
    launcher's flags and help, the mesh order and the data-parallel groups are derived from it."""

    name: str
    data: bool
    help: str
    borrows: tuple[str, ...] = ()  # the mesh axes whose processes it reuses (no factor of the product rule)


AXIS_TABLE = (
    Axis("pp", False, "Pipeline stages' processes (pipeline parallelism; the outermost mesh dimension)."),
    Axis("dp_replicate", True, "Full copies of the model (HSDP with dp_shard_size > 1)."),
    Axis("dp_shard", True, "Processes one copy is sharded over (FSDP2; needs --use_fsdp)."),
    Axis("cp", False, "Processes a sequence is split over (context parallelism: ring attention; CUDA or CPU)."),
    Axis("sp", False, "Processes a sequence is split over (sequence parallelism: Ulysses all-to-all over heads)."),
    Axis("tp", False, "Processes each layer is split over (tensor parallelism)."),
    Axis("ep", False, "Processes the routed experts of a mixture-of-experts model are split over (expert "
                      "parallelism; borrows dp_shard x cp x sp x tp processes, needs --use_fsdp).",
         borrows=("dp_shard", "cp", "sp", "tp")),
)
AXES = tuple(axis.name for axis in AXIS_TABLE if not axis.borrows)  # the mesh order, outermost first
SIZED_AXES = tuple(axis.name for axis in AXIS_TABLE)  # every ``<name>_size`` setting (the mesh's and borrowed)
BORROWED = tuple(axis.name for axis in AXIS_TABLE if axis.borrows)
DATA_AXES = tuple(axis.name for axis in AXIS_TABLE if axis.data)  # flattened into the data-parallel rank


class Spelling:
    """How a message names a size and asks for another one (a Python argument: ``tp_size=2``)."""

    prefix = "ParallelismConfig: "
    fsdp = "fsdp_plugin"
    only_enabled = False  # show only the sizes above 1

    def size(self, axis: str, value: int) -> str:
        return f"{axis}_size={value}"

    def use(self, axis: str, value: int) -> str:
        return f"{axis}_size={value}"

    def job(self, world_size: int) -> str:
        return str(world_size)

    def processes(self, count: int) -> str:
        return f"hasten launch --num_processes {count}"


@dataclass(frozen=True)
class Layout:
    """Sizes of every axis of a job of ``world_size`` processes (each a whole number >= 1).

    Built from a ``ParallelismConfig`` (``Layout.from_config``) or a ``{axis: size}`` mapping
    (``Layout.from_sizes``); ``check()`` raises when the sizes cannot lay out the job.
    """

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1  # borrowed from dp_shard x cp x sp x tp (expert_problem), no factor of the product

    def __post_init__(self) -> None:
        for name in ("world_size",) + SIZED_AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                shown = name if name == "world_size" else f"{name}_size"
                raise ValueError(f"{shown}={value!r} must be a whole number >= 1")

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_sizes(cls, sizes: Mapping[str, Any], world_size: int) -> "Layout":
        """``sizes``: size per axis name (missing axes are 1)."""
        names = {f.name for f in fields(cls)} - {"world_size"}
        unknown = sorted(set(sizes) - names)
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {unknown}; use {list(SIZED_AXES)}")
        return cls(world_size, **{name: sizes[name] for name in sizes})

    @classmethod
    def from_config(cls, config: Any, world_size: int) -> "Layout":
        """The layout a ``ParallelismConfig`` asks for on ``world_size`` processes."""
        return cls.from_sizes(config.all_sizes() if hasattr(config, "all_sizes") else config.sizes(), world_size)

    @classmethod
    def asked(cls, sizes: Mapping[str, Any], world_size: int) -> Optional["Layout"]:
        """The layout ``sizes`` ask for, or None when they ask for nothing (every size 1 on several
        processes: the strategy lays the job out itself, DDP replicas or FSDP2 over all). ``ep`` alone
        asks for FSDP2's own layout, every process one ``dp_shard``, with the experts split over ``ep``."""
        layout = cls.from_sizes(sizes, world_size)
        if layout.product == 1 and world_size > 1:
            return cls.from_sizes({**sizes, "dp_shard": world_size}, world_size) if layout.ep > 1 else None
        return layout

    # -- views ----------------------------------------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        """Size per axis, in mesh order."""
        return {name: getattr(self, name) for name in AXES}

    @property
    def product(self) -> int:
        total = 1
        for name in AXES:
            total *= getattr(self, name)
        return total

    @property
    def enabled(self) -> tuple[str, ...]:
        """The axes larger than 1, in mesh order."""
        return tuple(name for name in AXES if getattr(self, name) > 1)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    def mesh_names_and_shape(self, keep: tuple[str, ...] = ()) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The torch mesh's dimension names and sizes: the axes larger than 1 (or kept), in mesh order."""
        names = tuple(n for n in AXES if getattr(self, n) > 1 or n in keep) or ("dp_shard",)
        return names, tuple(getattr(self, n) for n in names)

    def shown(self, spelling: Optional[Spelling] = None) -> str:
        """``pp_size=2 x dp_replicate_size=1 x ...`` (pp and sp only when used)."""
        spelling = spelling or Spelling()
        names = [n for n in AXES if getattr(self, n) > 1 or (not spelling.only_enabled and n not in ("pp", "sp"))]
        return " x ".join(spelling.size(n, getattr(self, n)) for n in names or ["dp_shard"])

    # -- the rules ------------------------------------------------------------------------------------
    def mismatch(self, spelling: Optional[Spelling] = None) -> Optional[str]:
        """The product rule: the sizes multiply to the number of processes. The message, or None."""
        if self.product == self.world_size:
            return None
        spelling = spelling or Spelling()
        other = self.product // self.dp_shard
        example = (f" (e.g. {spelling.use('dp_shard', self.world_size // other)}, the other sizes unchanged)"
                   if self.world_size % other == 0 else "")
        return (f"{spelling.prefix}{self.shown(spelling)} = {self.product} processes, but this job runs "
                f"{spelling.job(self.world_size)}; make the product of the sizes {self.world_size}{example}, or run "
                f"{self.product} processes ({spelling.processes(self.product)})")

    def composition_problem(self, spelling: Optional[Spelling] = None) -> Optional[str]:
        """Tensor/context parallelism composes with FSDP2, not with plain replication."""
        if not ((self.tp > 1 or self.cp > 1) and self.dp_replicate > 1 and self.dp_shard == 1):
            return None
        s = spelling or Spelling()
        other = s.size("tp", self.tp) if self.tp > 1 else s.size("cp", self.cp)
        return (f"{s.prefix}{s.size('dp_replicate', self.dp_replicate)} with {other} and {s.size('dp_shard', 1)}: "
                f"tensor/context parallelism composes with FSDP2, not with plain replication; use "
                f"{s.use('dp_shard', self.dp_replicate)} and {s.use('dp_replicate', 1)} (with {s.fsdp})")

    @property
    def expert_block(self) -> int:
        """The processes ``ep`` borrows from: one model copy's ``dp_shard x cp x sp x tp`` (per pipeline stage)."""
        total = 1
        for name in next(a for a in AXIS_TABLE if a.name == "ep").borrows:
            total *= getattr(self, name)
        return total

    def expert_problem(self, spelling: Optional[Spelling] = None) -> Optional[str]:
        """Expert parallelism borrows ``ep`` consecutive processes of the ``dp_shard x cp x sp x tp`` block
        (``expert_block``): ep divides it. With pipeline stages each stage's block splits its experts."""
        if self.ep == 1 or self.expert_block % self.ep == 0:
            return None
        s = spelling or Spelling()
        block = self.expert_block
        fits = max(d for d in range(1, block + 1) if block % d == 0 and d <= self.ep)
        used = [n for n in ("dp_shard", "cp", "sp", "tp") if getattr(self, n) > 1 or n == "dp_shard"]
        parts = " x ".join(s.size(n, getattr(self, n)) for n in used) + (f" = {block}" if len(used) > 1 else "")
        return (f"{s.prefix}{s.size('ep', self.ep)} does not divide {parts}: the experts are split over ep "
                f"of the processes of one model copy (it borrows them, it does not add any); use {s.use('ep', fits)} "
                f"or sizes whose product ep divides")

    def sequence_problem(self, spelling: Optional[Spelling] = None) -> Optional[str]:
        """Sequence parallelism (Ulysses, ``sp``) splits the same sequences context parallelism does, so
        the two exclude each other (as Accelerate's rule), and it composes with data parallelism only."""
        if self.sp == 1:
            return None
        s = spelling or Spelling()
        if self.cp > 1:
            return (f"{s.prefix}{s.size('cp', self.cp)} with {s.size('sp', self.sp)}: context and sequence "
                    f"parallelism both split the sequences; use one of them ({s.use('cp', 1)} or {s.use('sp', 1)})")
        other = [a for a in ("tp", "pp") if getattr(self, a) > 1]
        if other:
            return (f"{s.prefix}{s.size('sp', self.sp)} with {s.size(other[0], getattr(self, other[0]))}: sequence "
                    f"parallelism composes with data parallelism (dp_replicate, dp_shard) only in hasten; use "
                    f"{s.use(other[0], 1)}, or {s.use('cp', self.sp)} instead of sp")
        return None

    def device_problem(self, device_type: str, spelling: Optional[Spelling] = None) -> Optional[str]:
        """Context parallelism runs torch's ring attention with the CUDA kernels, or hasten's CPU path
        (``strategies/ring_attention.py``); other devices have neither."""
        if self.cp == 1 or device_type in ("cuda", "cpu"):
            return None
        s = spelling or Spelling()
        return (f"{s.prefix}{s.size('cp', self.cp)} runs on CUDA or the CPU, not on {device_type} (torch's ring "
                f"attention has no kernel there); use {s.use('cp', 1)}, or {s.use('sp', self.cp)} (sequence "
                f"parallelism: all-to-all, any device)")

    def check(self, spelling: Optional[Spelling] = None, device_type: Optional[str] = None) -> "Layout":
        """Raise ``ValueError`` with the first rule this layout breaks; return it otherwise."""
        problem = (self.mismatch(spelling) or self.composition_problem(spelling) or self.sequence_problem(spelling)
                   or self.expert_problem(spelling)
                   or (self.device_problem(device_type, spelling) if device_type else None))
        if problem:
            raise ValueError(problem)
        return self
