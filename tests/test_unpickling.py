"""The allow-list unpickler of other libraries' checkpoint pickles (DCP metadata, DeepSpeed files)."""

import io
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, _MEM_FORMAT_ENCODING

from distributed import evil_pickle
from hasten.files import unpickling
from hasten.files.unpickling import ForbiddenPickle


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _pickle(*ops: bytes) -> bytes:
    return b"\x80\x04" + b"".join(ops) + b"."


@pytest.fixture
def written(tmp_path):
    """A DCP checkpoint with nested, sharded-like and non-tensor entries, written in this process."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.99))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model_0": model.state_dict(), "optimizer_0": opt.state_dict(), "count": 3,
             "half": torch.zeros(2, dtype=torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ck")), no_dist=True)
    return tmp_path / "ck"


def test_dcp_metadata_equals_what_pickle_reads(written):
    ours = unpickling.dcp_metadata(str(written / ".metadata"))
    theirs = dcp.FileSystemReader(str(written)).read_metadata()
    theirs.storage_meta.load_id = None
    assert isinstance(ours, Metadata) and ours == theirs


def test_a_foreign_global_is_refused_before_it_runs(tmp_path):
    path, marker = tmp_path / ".metadata", tmp_path / "created"
    path.write_bytes(evil_pickle(str(marker)))
    with pytest.raises(ForbiddenPickle) as caught:
        unpickling.dcp_metadata(str(path))
    assert not marker.exists()
    message = str(caught.value)
    assert repr(str(path)) in message and "global io.open" in message and "tampered" in message, message
    with pytest.raises(ForbiddenPickle, match="global io.open"):
        unpickling.torch_file(str(path), "DeepSpeed checkpoint", (), mmap=True)  # not a zip file: read plainly
    assert not marker.exists()


@pytest.mark.parametrize("attack", ["class", "function", "enum member"])
def test_a_pickle_cannot_change_what_it_resolved(tmp_path, attack):
    """pickle's BUILD given a resolved class, function or enum member would change it for the whole
    process; it is refused and undone."""
    metadata = "torch.distributed.checkpoint.metadata"
    data = {
        "class": _pickle(_global(metadata, "Metadata"), b"N}\x8c\x08__repr__", _global("torch", "Size"), b"s\x86b"),
        "function": _pickle(_global("torch.serialization", "_get_layout"), b"}\x8c\x05cache}sb"),
        "enum member": _pickle(_global(metadata, "_MEM_FORMAT_ENCODING"), b"K\x00\x85R}\x8c\x07_value_K\x05sb"),
    }[attack]
    (tmp_path / "f").write_bytes(data)
    before = (Metadata.__repr__, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value, torch.serialization._get_layout)
    with pytest.raises(ForbiddenPickle, match="tampered"):
        unpickling.dcp_metadata(str(tmp_path / "f"))
    assert (Metadata.__repr__, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value,
            torch.serialization._get_layout) == before
    assert "__repr__" not in vars(Metadata) or vars(Metadata)["__repr__"] is before[0]
    assert torch.serialization._get_layout("torch.strided") is torch.strided
    assert TensorProperties().memory_format == torch.contiguous_format


def test_damaged_metadata_is_named(tmp_path):
    (tmp_path / "m").write_bytes(b"not a pickle")
    with pytest.raises(pickle.UnpicklingError, match="cannot read the DCP metadata"):
        unpickling.dcp_metadata(str(tmp_path / "m"))
    (tmp_path / "m").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(pickle.UnpicklingError, match="holds a dict, not DCP metadata"):
        unpickling.dcp_metadata(str(tmp_path / "m"))


class Record:
    """Stands in for a library's plain record class (DeepSpeed's LossScaler)."""

    def __init__(self, scale):
        self.scale = scale


def test_torch_file_allows_tensors_and_the_listed_records_only(tmp_path):
    path = tmp_path / "states.pt"
    param = torch.nn.Parameter(torch.arange(4.0))
    torch.save({"module": {"w": torch.ones(2, 3)}, "p": param, "scaler": Record(8.0), "shape": torch.Size([2]),
                "dtype": torch.bfloat16}, path)
    with pytest.raises(ForbiddenPickle, match=f"global {__name__}.Record"):
        unpickling.torch_file(str(path), "DeepSpeed checkpoint", ())
    for mmap in (False, True):
        loaded = unpickling.torch_file(str(path), "DeepSpeed checkpoint", [(__name__, "Record")], mmap=mmap)
        assert torch.equal(loaded["module"]["w"], torch.ones(2, 3)) and torch.equal(loaded["p"], param)
        assert isinstance(loaded["p"], torch.nn.Parameter) and loaded["scaler"].scale == 8.0
        assert loaded["shape"] == torch.Size([2]) and loaded["dtype"] is torch.bfloat16
    legacy = io.BytesIO()
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    (tmp_path / "legacy.pt").write_bytes(legacy.getvalue())
    assert torch.equal(unpickling.torch_file(str(tmp_path / "legacy.pt"), "DeepSpeed checkpoint", (), mmap=True)["w"],
                       torch.ones(3))


class _Opens:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_dcp_values_are_read_weights_only(tmp_path):
    """DCP stores non-tensor values (optimizer hyperparameters) as pickles that its own planner reads with
    torch.load(weights_only=False); hasten's planner refuses one that names a foreign global."""
    from hasten.checkpointing.dcp_reader import MetadataReader, WeightsOnlyPlanner

    marker = tmp_path / "created"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.save({"w": torch.ones(2), "lr": 0.5, "value": _Opens(str(marker))},
                 storage_writer=dcp.FileSystemWriter(str(tmp_path / "ck")), no_dist=True)
        state = {"w": torch.zeros(2), "lr": 0.0}
        dcp.load(state, storage_reader=MetadataReader(str(tmp_path / "ck")), planner=WeightsOnlyPlanner(), no_dist=True)
        assert torch.equal(state["w"], torch.ones(2)) and state["lr"] == 0.5
        with pytest.raises(BaseException) as caught:  # DCP wraps what the planner raised (a BaseException)
            dcp.load({"value": None}, storage_reader=MetadataReader(str(tmp_path / "ck")), planner=WeightsOnlyPlanner(),
                     no_dist=True)
    assert not marker.exists()
    assert "checkpoint value 'value'" in str(caught.value) and "tampered" in str(caught.value), str(caught.value)
