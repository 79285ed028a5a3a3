"""Parallel strategies behind one interface (``Strategy``), built from the run's plan.

The plan (``hasten.planning.Plan``) names the strategy; ``hasten.strategy_rules.RULES`` says where
each named strategy lives, and its module is imported only when a run uses it.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..strategy_rules import strategy_rule
from .base import Strategy, foreign_wrapper, user_sharded


def strategy_class(name: str) -> type[Strategy]:
    """The class of the strategy named ``name`` (imported on first use)."""
    module, _, cls = strategy_rule(name).where.partition(":")
    return getattr(importlib.import_module(f".{module}", __name__), cls)


def build_strategy(plan: Any) -> Strategy:
    """The strategy ``plan.strategy`` names, set up for ``plan`` (with its torch device mesh when the
    plan has an N-D layout and several processes: built collectively, by every process, here)."""
    strategy = strategy_class(plan.strategy)(plan)
    if plan.parallelism_config is not None and plan.state.use_distributed:
        strategy.mesh.device_mesh()  # collective: built here by every process, as Accelerate does
    return strategy


__all__ = ["Strategy", "build_strategy", "foreign_wrapper", "strategy_class", "user_sharded"]
