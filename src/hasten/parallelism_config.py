"""``hasten.parallelism_config`` (Accelerate's module path); the class lives in ``hasten.utils.parallelism_config``."""

from .utils.parallelism_config import ParallelismConfig

__all__ = ["ParallelismConfig"]
