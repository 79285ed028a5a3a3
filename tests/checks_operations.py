"""Checks of the collectives and RNG helpers, run inside each rank (see distributed.py).

``check_debug_*`` run in a launch with HASTEN_DEBUG=1, the others in launches without it. Checks
marked ``@on_rank_device`` make their tensors on the rank's device (NCCL moves CUDA tensors only);
the RNG checks draw from the CPU generators they synchronise, and exchange the draws as objects.
"""

import functools
import random
from collections import OrderedDict, namedtuple

import numpy as np
import torch
import torch.distributed as dist

from hasten.state import PartialState
from hasten.utils.operations import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from hasten.utils.random import set_seed, synchronize_rng_state, synchronize_rng_states

Pair = namedtuple("Pair", ["x", "y"])


def _rank_world():
    s = PartialState()
    return s.process_index, s.num_processes


def on_rank_device(check):
    """Run ``check`` with this rank's device as the default device of tensor factories."""

    @functools.wraps(check)
    def run():
        with torch.device(PartialState().device):
            return check()

    return run


def _expect_error(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as err:
        return str(err)
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


class _Counter:
    """Counts calls to torch.distributed.all_gather_object (the real one still runs)."""

    def __init__(self):
        self.calls = 0
        self.real = dist.all_gather_object

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)

        dist.all_gather_object = counted
        return self

    def __exit__(self, *exc):
        dist.all_gather_object = self.real


# -- gather -----------------------------------------------------------------------------------------
@on_rank_device
def check_gather_nested():
    r, w = _rank_world()
    matrix = torch.arange(6, dtype=torch.float32).reshape(3, 2).t() + 100 * r  # (2, 3), not contiguous
    data = OrderedDict(
        a=torch.tensor([[r, r + 0.5]]),
        b=[torch.arange(3) + 10 * r, (torch.tensor(r),)],
        p=Pair(x=torch.full((2,), r, dtype=torch.int32), y=torch.tensor([True, r == 0])),
        m=matrix,
    )
    with _Counter() as counter:
        out = gather(data)
    assert type(out) is OrderedDict and type(out["b"]) is list and type(out["b"][1]) is tuple
    assert type(out["p"]) is Pair
    assert out["b"][0].dtype == torch.int64 and out["p"].x.dtype == torch.int32 and out["p"].y.dtype == torch.bool
    assert out["a"].dtype == torch.float32
    return {
        "a": out["a"].tolist(), "b0": out["b"][0].tolist(), "scalar": out["b"][1][0].tolist(),
        "scalar_shape": list(out["b"][1][0].shape), "px": out["p"].x.tolist(), "py": out["p"].y.tolist(),
        "m": out["m"].tolist(), "extra_object_collectives": counter.calls,
    }


def check_gather_object():
    r, w = _rank_world()
    listed = gather_object([f"r{r}", {"rank": r}])
    single = gather_object({"rank": r})
    return {"listed": listed, "single": single}


@on_rank_device
def check_gather_rejects_non_tensors():
    r, w = _rank_world()
    if w == 1:
        return "single process: input returned as is"
    return _expect_error(TypeError, gather, {"ok": torch.zeros(1), "bad": "text"})


# -- broadcast --------------------------------------------------------------------------------------
@on_rank_device
def check_broadcast():
    r, w = _rank_world()
    src = w - 1
    x = torch.full((3, 2), float(r)).t()  # not contiguous: filled in place anyway
    data = {"x": x, "y": [torch.tensor([r, r + 1])]}
    out = broadcast(data, from_process=src)
    assert out["x"] is x  # in place, like torch.distributed.broadcast
    objects = broadcast_object_list([f"from {r}", {"rank": r}], from_process=0)
    return {"x": out["x"].tolist(), "y": out["y"][0].tolist(), "objects": objects}


@on_rank_device
def check_broadcast_bad_source():
    r, w = _rank_world()
    if w == 1:
        return "single process"
    return _expect_error(ValueError, broadcast, torch.zeros(1), from_process=5)


# -- reduce -----------------------------------------------------------------------------------------
@on_rank_device
def check_reduce_modes():
    r, w = _rank_world()
    values = {}
    for mode in ("sum", "mean", "max", "min", "none"):
        t = torch.tensor([1.0 + r, 10.0 * (r + 1)])
        out = reduce({"v": [t]}, reduction=mode)
        assert torch.equal(t, torch.tensor([1.0 + r, 10.0 * (r + 1)]))  # input untouched
        values[mode] = out["v"][0].tolist()
    values["default"] = reduce(torch.tensor([1.0 + r])).tolist()
    values["scaled_sum"] = reduce(torch.tensor([1.0 + r]), reduction="sum", scale=2.0).tolist()
    int_mean = reduce(torch.tensor([1 + r]), reduction="mean")
    values["int_mean"] = [int_mean.tolist(), str(int_mean.dtype)]
    int_sum = reduce(torch.tensor([1 + r]), reduction="sum")
    values["int_sum"] = [int_sum.tolist(), str(int_sum.dtype)]
    values["bad_mode"] = _expect_error(ValueError, reduce, torch.zeros(1), reduction="avg")
    values["bad_type"] = _expect_error(TypeError, reduce, {"x": [torch.zeros(1), 3.5]})
    return values


# -- pad_across_processes ---------------------------------------------------------------------------
@on_rank_device
def check_pad_across_processes():
    r, w = _rank_world()
    rows = torch.full((2 + 2 * r, 2), float(r + 1))  # 2 rows on rank 0, 4 on rank 1
    cols = torch.full((1, 1 + r), r + 1, dtype=torch.int64)  # padded along dim 1
    flat = torch.arange(3)  # no dim 1: left alone
    last = pad_across_processes({"rows": rows, "more": [rows[:1]]}, pad_index=-1)
    first = pad_across_processes(rows, pad_index=-1, pad_first=True)
    by_col = pad_across_processes([cols, flat], dim=1, pad_index=7)
    negative = pad_across_processes(cols, dim=-1)
    gathered = gather(last["rows"])  # padded tensors can be gathered
    assert by_col[1] is flat
    return {
        "last": last["rows"].tolist(), "more": last["more"][0].tolist(), "first": first.tolist(),
        "by_col": by_col[0].tolist(), "negative": negative.tolist(), "gathered_shape": list(gathered.shape),
    }


# -- send_to_device ---------------------------------------------------------------------------------
class _Movable:
    """Stands for objects such as transformers' BatchEncoding that have their own ``.to``."""

    def __init__(self):
        self.moved_to = None

    def to(self, device, non_blocking=False):
        self.moved_to = str(device)
        return self


def check_send_to_device():
    t = torch.ones(2)
    movable = _Movable()
    data = {"a": [t, "text", 3], "b": Pair(x=t, y=(t,)), "m": movable, "keep": t}
    out = send_to_device(data, torch.device("cpu"), skip_keys="keep")
    assert type(out["b"]) is Pair and type(out["b"].y) is tuple and out["a"][1:] == ["text", 3]
    assert out["keep"] is t and movable.moved_to == "cpu"
    meta = send_to_device({"x": [torch.ones(2)]}, "meta")
    assert meta["x"][0].device.type == "meta"
    return "ok"


# -- extra communication ----------------------------------------------------------------------------
@on_rank_device
def check_no_extra_collective_without_debug():
    r, w = _rank_world()
    assert not PartialState().debug
    with _Counter() as counter:
        gather(torch.ones(2))
        reduce(torch.ones(2))
        broadcast(torch.ones(2))
        pad_across_processes(torch.ones(2 + r))
    return counter.calls


# -- random -----------------------------------------------------------------------------------------
def _draw():
    return [torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def check_set_seed():
    set_seed(1234, device_specific=True)
    specific = gather_object([_draw()])
    set_seed(1234)
    shared = gather_object([_draw()])
    set_seed(1234)
    again = _draw()
    return {"specific": specific, "shared": shared, "again": again}


def check_synchronize_rng_states():
    r, w = _rank_world()
    generator = torch.Generator().manual_seed(r)
    set_seed(100 + r)
    synchronize_rng_states(["torch", "generator"], generator=generator)
    draws = [torch.rand(4).tolist(), torch.rand(4, generator=generator).tolist()]
    everyone = gather_object([draws])
    set_seed(100)
    rank0_own = [torch.rand(4).tolist(), torch.rand(4, generator=torch.Generator().manual_seed(0)).tolist()]
    errors = [
        _expect_error(ValueError, synchronize_rng_state, "bogus"),
        _expect_error(ValueError, synchronize_rng_state, "generator"),
    ]
    if not torch.cuda.is_available():
        errors.append(_expect_error(ValueError, synchronize_rng_state, "cuda"))
    return {"everyone": everyone, "rank0_own": rank0_own, "errors": errors}


# -- debug mode (HASTEN_DEBUG=1) --------------------------------------------------------------------
@on_rank_device
def check_debug_shape_mismatch():
    r, w = _rank_world()
    assert PartialState().debug and w == 2
    try:
        gather({"x": torch.zeros(2 + r, 3)})
    except DistributedOperationException as err:
        assert isinstance(err, RuntimeError)
        return str(err)
    raise AssertionError("gather of different shapes did not raise in debug mode")


@on_rank_device
def check_debug_different_operations():
    r, w = _rank_world()
    t = torch.ones(2)
    try:
        gather(t) if r == 0 else reduce(t, reduction="sum")
    except DistributedOperationException as err:
        return str(err)
    raise AssertionError("different collectives on the two ranks did not raise in debug mode")


@on_rank_device
def check_debug_other_mismatches():
    r, w = _rank_world()
    messages = {
        "reduce_mode": _expect_error(DistributedOperationException, reduce, torch.ones(2),
                                     reduction="sum" if r == 0 else "max"),
        "broadcast_source": _expect_error(DistributedOperationException, broadcast, torch.ones(2), from_process=r),
        "structure": _expect_error(DistributedOperationException, reduce, {"a" if r == 0 else "b": torch.ones(2)}),
        "dtype": _expect_error(DistributedOperationException, broadcast,
                               torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64)),
        "pad_ndim": _expect_error(DistributedOperationException, pad_across_processes,
                                  torch.ones(2) if r == 0 else torch.ones(2, 2)),
        "object_vs_tensor": _expect_error(DistributedOperationException, gather_object, [r])
        if r == 0 else _expect_error(DistributedOperationException, gather, torch.ones(1)),
    }
    return messages


@on_rank_device
def check_debug_matching_calls_work():
    r, w = _rank_world()
    with _Counter() as counter:
        gathered = gather({"x": torch.tensor([r])})["x"].tolist()
        summed = reduce(torch.tensor([1.0 + r]), reduction="sum").tolist()
        padded = pad_across_processes(torch.ones(1 + r, 2), pad_index=0).tolist()  # sizes may differ here
        # along dim 1; the 1-d tensor has no dim 1, so it is left alone whatever its length
        by_col = [t.tolist() for t in pad_across_processes([torch.ones(1, 1 + r), torch.ones(3 + r)], dim=1)]
        sent = broadcast(torch.tensor([r]), from_process=1).tolist()
        objects = gather_object([r])
    return {"gathered": gathered, "summed": summed, "padded": padded, "sent": sent, "objects": objects,
            "by_col": by_col, "object_collectives": counter.calls}


# -- logging ----------------------------------------------------------------------------------------
def check_logger_in_order():
    """in_order=True: rank 0 logs first even when it is the slower one."""
    import logging
    import os
    import time

    from hasten.logging import get_logger

    r, w = _rank_world()
    path = os.path.join(os.environ["HASTEN_TEST_TMP"], "in_order.log")
    handler = logging.FileHandler(path)
    logger = get_logger("hasten.tests.in_order", log_level="INFO")
    logger.logger.addHandler(handler)
    try:
        if r == 0:
            time.sleep(0.3)  # without in_order, rank 1 would write first
        logger.info("ordered", in_order=True)
        logger.info("main only")
        logger.info("everyone", main_process_only=False)
    finally:
        logger.logger.removeHandler(handler)
        handler.close()
    PartialState().wait_for_everyone()
    with open(path) as f:
        return f.read().splitlines()
