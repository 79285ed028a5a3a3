"""``hasten.inference``: Accelerate's module of this name holds pipeline-parallel inference (PiPPy),
which hasten does not offer. ``prepare_pippy`` imports, and raises on use naming the alternatives."""

from typing import Any, NoReturn

from .utils.compat import refusal


def prepare_pippy(model: Any, split_points: Any = "auto", no_split_module_classes: Any = None,
                  example_args: Any = (), example_kwargs: Any = None, num_chunks: Any = None,
                  gather_output: Any = False) -> NoReturn:
    """Not available in hasten (pipeline-parallel inference); see the error for what to use."""
    raise refusal("prepare_pippy")
