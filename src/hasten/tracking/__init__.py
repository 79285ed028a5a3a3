"""Experiment trackers under Accelerate's names (``accelerate.tracking``).

``Accelerator(log_with=...)`` selects them; each built-in tracker imports its own package only
when its run starts, so importing hasten (or this module) imports no tracker package.

- ``base``: ``GeneralTracker`` (subclass it for your own tracker), value conversion
- ``local``: TensorBoard, Aim, DVCLive, Trackio (local files)
- ``hosted``: wandb, MLflow, Comet, ClearML, SwanLab (each also works offline)
- ``registry``: names, availability, checking ``log_with``
- ``mixin``: the ``Accelerator`` methods
"""

from ..utils.dataclasses import LoggerType
from .base import GeneralTracker, on_main_process
from .hosted import ClearMLTracker, CometMLTracker, MLflowTracker, SwanLabTracker, WandBTracker
from .local import AimTracker, DVCLiveTracker, TensorBoardTracker, TrackioTracker
from .registry import (
    LOGGER_TYPE_TO_CLASS,
    filter_trackers,
    get_available_trackers,
    is_tracker_available,
    register_tracker_class,
)

__all__ = [
    "AimTracker", "ClearMLTracker", "CometMLTracker", "DVCLiveTracker", "GeneralTracker", "LOGGER_TYPE_TO_CLASS",
    "LoggerType", "MLflowTracker", "SwanLabTracker", "TensorBoardTracker", "TrackioTracker", "WandBTracker",
    "filter_trackers", "get_available_trackers", "is_tracker_available", "on_main_process", "register_tracker_class",
]
