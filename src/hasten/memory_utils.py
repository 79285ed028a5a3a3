"""Old location of ``find_executable_batch_size`` (as in Accelerate): import it from ``hasten`` instead."""

import warnings

from .utils.memory import find_executable_batch_size  # noqa: F401 - re-exported for old imports

warnings.warn("hasten.memory_utils is kept for old imports; use `from hasten import find_executable_batch_size`",
              FutureWarning, stacklevel=2)
