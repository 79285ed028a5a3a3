"""Where this process sits in the job: rank, world size, node, rendezvous address.

Read from whichever launcher started us: torchrun / ``hasten launch`` (``RANK``...), an MPI
runtime (Open MPI, MPICH/Intel MPI, MVAPICH) or SLURM's ``srun``. Torch-free on purpose, so the
launcher can use it too.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Topology:
    """The process layout of one job, as seen by one process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    source: str = "single"  # torchrun | mpi | slurm | single

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the data-parallel replicas.

    ``group`` is None when every process is its own replica (the default group serves);
    ``members`` lists, by data-parallel rank, the global rank of each replica's process at this
    process's position on the other axes (the processes of ``group``).
    """

    rank: int
    size: int
    group: Any = None
    members: Optional[tuple[int, ...]] = None


def _int(environ: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``gpu[03-05,9],cpu1`` -> ``gpu03``."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read a host name from SLURM node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _from_torchrun(env: Mapping[str, str]) -> Optional[Topology]:
    world = _int(env, "WORLD_SIZE")
    rank = _int(env, "RANK")
    if world is None or rank is None:
        return None
    local_world = _int(env, "LOCAL_WORLD_SIZE") or world
    local_rank = _int(env, "LOCAL_RANK")
    if local_rank is None:
        local_rank = rank % local_world
    node_rank = _int(env, "GROUP_RANK", "NODE_RANK")
    if node_rank is None:
        node_rank = rank // local_world
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=max(1, world // max(1, local_world)),
        master_addr=env.get("MASTER_ADDR"),
        master_port=_int(env, "MASTER_PORT"),
        source="torchrun",
    )


def _from_mpi(env: Mapping[str, str]) -> Optional[Topology]:
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK")
    if world is None or rank is None:
        return None
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE") or world
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
    if local_rank is None:
        local_rank = rank % local_world
    num_nodes = max(1, world // max(1, local_world))
    addr = env.get("MASTER_ADDR")
    if addr is None:
        if num_nodes > 1:
            raise ValueError(
                "running under MPI on several nodes but MASTER_ADDR is not set; "
                "export MASTER_ADDR=<address of rank 0's node> (e.g. mpirun -x MASTER_ADDR=...)"
            )
        addr = "127.0.0.1"
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=rank // local_world,
        num_nodes=num_nodes,
        master_addr=addr,
        master_port=_int(env, "MASTER_PORT") or DEFAULT_PORT,
        source="mpi",
    )


def slurm_master_addr(env: Mapping[str, str]) -> Optional[str]:
    """Rank 0's host inside a SLURM allocation."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        return first_host(nodelist)
    return env.get("SLURM_LAUNCH_NODE_IPADDR")


def slurm_port(env: Mapping[str, str]) -> int:
    """A port derived from the job id, so two jobs sharing a node do not collide."""
    port = _int(env, "MASTER_PORT")
    if port:
        return port
    job = _int(env, "SLURM_JOB_ID", "SLURM_JOBID")
    return DEFAULT_PORT if job is None else 20000 + job % 20000


def _from_slurm(env: Mapping[str, str]) -> Optional[Topology]:
    world = _int(env, "SLURM_NTASKS", "SLURM_NPROCS")
    rank = _int(env, "SLURM_PROCID")
    # A batch script's own shell also carries SLURM_PROCID=0; only a task started by srun (a job
    # step) is one rank of many.
    if world is None or rank is None or world < 2 or "SLURM_STEP_ID" not in env:
        return None
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
    local_world = _int(env, "SLURM_NTASKS_PER_NODE") or max(1, world // num_nodes)
    local_rank = _int(env, "SLURM_LOCALID")
    if local_rank is None:
        local_rank = rank % local_world
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(env, "SLURM_NODEID") or rank // local_world,
        num_nodes=num_nodes,
        master_addr=slurm_master_addr(env) or "127.0.0.1",
        master_port=slurm_port(env),
        source="slurm",
    )


def detect_topology(environ: Optional[Mapping[str, str]] = None) -> Topology:
    """The layout of this process, from the first launcher whose variables are present."""
    env = os.environ if environ is None else environ
    for reader in (_from_torchrun, _from_mpi, _from_slurm):
        topo = reader(env)
        if topo is not None:
            if not 0 <= topo.rank < topo.world_size:
                raise ValueError(
                    f"rank {topo.rank} is outside the world of {topo.world_size} processes "
                    f"(read from the {topo.source} environment); check the launcher's variables"
                )
            return topo
    return Topology()
