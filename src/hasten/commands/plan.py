"""``Plan``: what ``hasten launch`` will start, decided torch-free before anything runs.

``launch.build_plan`` makes it; ``elastic`` starts it with torch's elastic agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .launch_settings import Resolved


@dataclass
class Plan:
    """Everything needed to start the job, decided before torch is imported."""

    res: Resolved
    device: str
    distributed_type: str
    num_processes: int
    nproc_per_node: int
    num_machines: int
    machine_rank: int
    main_ip: str
    main_port: int
    rdzv_backend: str
    rdzv_configs: dict[str, Any]
    run_id: str
    entrypoint: str
    args: list[str]
    child_env: dict[str, str]
    direct: bool
    notes: dict[str, str] = field(default_factory=dict)
    # The launcher chose main_port itself (one machine, no port given): if another program binds it
    # before the rendezvous does, the launch may simply pick another (elastic.run_elastic).
    port_picked: bool = False

    @property
    def quiet(self) -> bool:
        return bool(self.res.values.get("quiet") and self.res["quiet"])
