import os
import sys

import pytest

# The suite's helpers (distributed.py, the check modules) import as plain modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _no_state_from_earlier_tests(request):
    """Every test starts without the process state an earlier test left behind. On a GPU machine a
    leftover state would put a later ``Accelerator(cpu=True)`` on the GPU (the state is a singleton)."""
    if "hasten.state" in sys.modules:
        from distributed import reset_state

        reset_state()
    yield
    # A default process group left behind would make later tests in this interpreter join it (and
    # skip their own set-up): end it here, and say which test left it, so the leak is not hidden.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        import warnings

        warnings.warn(f"{request.node.nodeid} left the default process group initialized; the suite destroyed it")


@pytest.fixture
def fresh_state():
    """A test that builds Accelerators starts and ends without any process state."""
    from distributed import reset_state

    reset_state()
    yield
    reset_state()


@pytest.fixture
def one_process_fsdp(fresh_state):
    """Tear down the one-process group FSDP made, so later tests in this interpreter start without one."""
    yield
    import torch.distributed as dist

    from hasten.state import PartialState

    if PartialState._shared_state and PartialState().initialized:
        PartialState().destroy_process_group()
    assert not dist.is_initialized()
