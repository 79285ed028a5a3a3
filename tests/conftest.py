import os
import sys

import pytest

# The suite's helpers (distributed.py, the check modules) import as plain modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def fresh_state():
    """A test that builds Accelerators starts and ends without any process state."""
    from distributed import reset_state

    reset_state()
    yield
    reset_state()
