"""In-process tests of the small utilities: batch-size finder, logger, tqdm, nested helpers, fp32 outputs."""

import logging
import pickle
import sys
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from hasten.logging import get_logger
from hasten.state import PartialState
from hasten.topology import Topology
from hasten.utils.memory import clear_device_cache, find_executable_batch_size, release_memory
from hasten.utils.operations import (
    ConvertOutputsToFp32,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    find_batch_size,
    recursively_apply,
)
from hasten.utils.random import set_seed

Point = namedtuple("Point", ["x", "y"])


@pytest.fixture
def as_rank(monkeypatch):
    """Make this process look like rank ``rank`` of a 2-process job (no communication is used)."""
    state = PartialState()

    def set_rank(rank, world_size=2):
        topology = Topology(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
        monkeypatch.setattr(state, "topology", topology)

    return set_rank


@pytest.fixture
def no_state():
    saved = dict(PartialState._shared_state)
    PartialState._shared_state.clear()
    yield
    PartialState._shared_state.clear()
    PartialState._shared_state.update(saved)


# -- find_executable_batch_size ---------------------------------------------------------------------
def _oom_above(limit, error):
    tried = []

    def train(batch_size, model, *, scale=1):
        tried.append(batch_size)
        if batch_size > limit:
            raise error
        return batch_size * scale, model

    return train, tried


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity)"),
    RuntimeError("XPU out of memory. Tried to allocate 1 GiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried"),
], ids=["OutOfMemoryError", "cuda", "xpu", "mps", "cpu"])
def test_batch_size_shrinks_by_a_tenth_until_it_fits(error):
    """Accelerate's rule (``int(size * 0.9)``), so a migrated script settles on the same batch size."""
    train, tried = _oom_above(60, error)
    decorated = find_executable_batch_size(train, starting_batch_size=128)
    assert decorated("model", scale=2) == (116, "model")
    assert tried == [128, 115, 103, 92, 82, 73, 65, 58]
    assert decorated("model") == (58, "model")  # the size that fitted is remembered
    assert tried[8:] == [58]


def test_batch_size_decorator_forms_and_custom_reduction():
    train, tried = _oom_above(100, torch.OutOfMemoryError("out of memory"))
    assert find_executable_batch_size(train)("m") == (92, "m")  # default start 128, as Accelerate gives
    sizes = iter([120, 90, 60])
    train, tried = _oom_above(100, torch.OutOfMemoryError("out of memory"))
    decorated = find_executable_batch_size(starting_batch_size=150, reduce_batch_size_fn=lambda: next(sizes))(train)
    assert decorated("m") == (90, "m") and tried == [150, 120, 90]


def test_batch_size_reaching_zero_raises():
    train, tried = _oom_above(0, torch.OutOfMemoryError("out of memory"))
    with pytest.raises(RuntimeError, match="every batch size down to 1") as info:
        find_executable_batch_size(train, starting_batch_size=8)("m")
    assert "started at 8" in str(info.value)
    assert tried == [8, 7, 6, 5, 4, 3, 2, 1]


@pytest.mark.parametrize("call", [lambda f: f(64, "m"), lambda f: f("m", batch_size=64)], ids=["positional", "keyword"])
def test_batch_size_passed_explicitly_is_a_type_error(call):
    train, tried = _oom_above(16, torch.OutOfMemoryError("out of memory"))
    with pytest.raises(TypeError, match="find_executable_batch_size passes the batch size") as info:
        call(find_executable_batch_size(train, starting_batch_size=32))
    assert "train() with the other arguments only" in str(info.value)
    assert tried == []


@pytest.mark.parametrize("error", [ValueError("bad data"), RuntimeError("shape mismatch"), KeyError("k")])
def test_batch_size_other_errors_propagate_untouched(error):
    train, tried = _oom_above(-1, error)
    with pytest.raises(type(error)) as info:
        find_executable_batch_size(train, starting_batch_size=32)("m")
    assert info.value is error and tried == [32]


def test_release_memory():
    a, b = torch.ones(3), [torch.ones(2)]
    a, b = release_memory(a, b)
    assert (a, b) == (None, None)
    clear_device_cache(garbage_collection=True)


# -- logging ----------------------------------------------------------------------------------------
def test_logger_logs_on_main_process_only_by_default(as_rank, caplog):
    logger = get_logger("hasten.tests.misc", log_level="INFO")
    as_rank(0)
    with caplog.at_level(logging.INFO, logger="hasten.tests.misc"):
        logger.info("from main %s", 1)
    as_rank(1)
    with caplog.at_level(logging.INFO, logger="hasten.tests.misc"):
        logger.info("hidden")
        logger.warning("everyone %d", 2, main_process_only=False)
        logger.debug("below the level", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] from main 1", "[RANK 1] everyone 2"]
    assert {r.filename for r in caplog.records} == {"test_utils_misc.py"}  # the caller, not hasten/logging.py


def test_logger_warning_once(as_rank, caplog):
    as_rank(0, world_size=1)
    logger = get_logger("hasten.tests.once")
    with caplog.at_level(logging.WARNING, logger="hasten.tests.once"):
        for _ in range(3):
            logger.warning_once("careful %s", "x")
        logger.warning_once("careful %s", "y")
    assert [r.getMessage() for r in caplog.records] == ["careful x", "careful y"]
    assert caplog.records[0].filename == "test_utils_misc.py"


def test_logger_before_any_state_logs_normally(no_state, caplog):
    logger = get_logger("hasten.tests.early", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="hasten.tests.early"):
        logger.info("early", main_process_only=True)
        logger.info("early in order", in_order=True)
    assert [r.getMessage() for r in caplog.records] == ["early", "early in order"]
    assert not PartialState._shared_state  # logging did not create the state


def test_logger_level_from_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "error")
    assert get_logger("hasten.tests.env1").logger.level == logging.ERROR
    monkeypatch.setenv("HASTEN_LOG_LEVEL", "debug")
    assert get_logger("hasten.tests.env2").logger.level == logging.DEBUG
    assert get_logger("hasten.tests.env3", log_level="WARNING").logger.level == logging.WARNING
    with pytest.raises(ValueError, match="'LOUD' is not a logging level"):
        get_logger("hasten.tests.env4", log_level="LOUD")


# -- tqdm -------------------------------------------------------------------------------------------
def test_tqdm_only_on_local_main_process(as_rank):
    from hasten.utils import tqdm

    as_rank(0)
    assert tqdm(range(3)).disable is False
    as_rank(1)
    assert tqdm(range(3)).disable is True
    assert tqdm(range(3), main_process_only=False).disable is False
    assert tqdm(False, range(3)).disable is False  # Accelerate's old positional form
    bar = tqdm(True, range(3), total=3)
    assert bar.disable is True and bar.total == 3


def test_tqdm_missing_package_says_how_to_install(monkeypatch):
    from hasten.utils.tqdm import tqdm

    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # makes `import tqdm.auto` fail
    with pytest.raises(ImportError, match="pip install tqdm"):
        tqdm(range(3))


# -- nested helpers ---------------------------------------------------------------------------------
def test_recursively_apply_keeps_container_types():
    data = [OrderedDict(p=Point(x=torch.ones(1), y=(torch.zeros(2), "s"))), defaultdict(list, q=torch.ones(1))]
    out = recursively_apply(lambda t: t + 1, data)
    assert type(out) is list and type(out[0]) is OrderedDict and type(out[0]["p"]) is Point
    assert type(out[0]["p"].y) is tuple and out[0]["p"].y[1] == "s"
    assert out[0]["p"].x.tolist() == [2.0] and out[0]["p"].y[0].tolist() == [1.0, 1.0]
    assert type(out[1]) is defaultdict and out[1].default_factory is list and out[1]["q"].tolist() == [2.0]
    with pytest.raises(TypeError) as refused:  # Accelerate's exact words, which its tests compare
        recursively_apply(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
    assert str(refused.value) == ("Unsupported types (<class 'int'>) passed to `tensor`. Only nested list/tuple/dicts "
                                  "of objects that are valid for `is_torch_tensor` should be passed.")


def test_find_batch_size_and_concatenate():
    batch = {"ids": torch.zeros(4, 7), "mask": [torch.ones(4)]}
    assert find_batch_size(batch) == 4 and find_batch_size([Point(torch.ones(3), None)]) == 3
    with pytest.raises(ValueError, match="empty"):
        find_batch_size([])
    with pytest.raises(TypeError, match="got a str"):
        find_batch_size({"text": "hello"})
    joined = concatenate([batch, batch])
    assert joined["ids"].shape == (8, 7) and joined["mask"][0].shape == (8,)


class _HalfModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return {"half": (x * self.scale).half(), "bf16": [x.bfloat16()], "count": torch.tensor(3), "name": "out"}


def test_convert_outputs_to_fp32():
    model = _HalfModel()
    model.forward = convert_outputs_to_fp32(model.forward)
    assert isinstance(model.forward, ConvertOutputsToFp32) and model.forward.__wrapped__.__self__ is model
    out = model(torch.tensor([1.5]))
    assert out["half"].dtype == out["bf16"][0].dtype == torch.float32
    assert out["count"].dtype == torch.int64 and out["name"] == "out"
    assert out["half"].tolist() == [1.5]
    # A wrapped model still pickles (torch.save of a whole model, multiprocessing) and keeps converting.
    clone = pickle.loads(pickle.dumps(model))
    assert clone(torch.tensor([2.0]))["half"].dtype == torch.float32
    assert convert_to_fp32((torch.ones(1, dtype=torch.float16), 2))[0].dtype == torch.float32


def test_set_seed_deterministic(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored afterwards
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    try:
        set_seed(7, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        first = torch.rand(2).tolist()
        set_seed(7)
        assert torch.rand(2).tolist() == first
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.raises(TypeError, match="integer seed"):
        set_seed("42")
