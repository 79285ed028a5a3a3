import os
import sys

import pytest

# The suite's helpers (distributed.py, the check modules) import as plain modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _no_state_from_earlier_tests():
    """Every test starts without the process state an earlier test left behind. On a GPU machine a
    leftover state would put a later ``Accelerator(cpu=True)`` on the GPU (the state is a singleton)."""
    if "hasten.state" in sys.modules:
        from distributed import reset_state

        reset_state()
    yield


@pytest.fixture
def fresh_state():
    """A test that builds Accelerators starts and ends without any process state."""
    from distributed import reset_state

    reset_state()
    yield
    reset_state()
