"""Accelerate's public names in hasten: every one imports, refused ones raise on use, the compatibility
table is current, and the names the issue lists first behave like Accelerate's.

The name list is checked in (tools/accelerate_names.json), so most of this runs without Accelerate;
comparisons with Accelerate's results are skipped when it is not installed.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import hasten
import hasten.utils
from hasten.utils.compat import BIG_MODEL, DIFFERENT, REFUSED, TOP_LEVEL_ONLY, FeatureNotAvailableError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "tools", "accelerate_names.json")) as _f:
    NAMES = json.load(_f)

try:
    import accelerate
    import accelerate.utils
    SAME_ACCELERATE = accelerate.__version__ == NAMES["accelerate_version"]
except ImportError:  # pragma: no cover - accelerate is in the test extra
    accelerate = None
    SAME_ACCELERATE = False
needs_accelerate = pytest.mark.skipif(not SAME_ACCELERATE, reason=f"needs accelerate {NAMES['accelerate_version']}")


def _pending(name: str, namespace: object) -> bool:
    # big-model inference arrives in a separate change; until then its names may be absent
    return name in BIG_MODEL and name not in getattr(namespace, "__all__", ())


# -- every name imports ---------------------------------------------------------------------------
def test_every_accelerate_utils_name_imports_from_hasten_utils():
    absent = [n for n in NAMES["utils"] if not _pending(n, hasten.utils) and not hasattr(hasten.utils, n)]
    assert not absent, f"hasten.utils lacks {absent}"
    assert len(NAMES["utils"]) >= 260


def test_every_top_level_name_and_module_imports():
    absent = [n for n in NAMES["top_level"] if not _pending(n, hasten) and not hasattr(hasten, n)]
    assert not absent, f"hasten lacks {absent}"
    for module in NAMES["top_level_modules"]:
        if module in BIG_MODEL and importlib.util.find_spec(f"hasten.{module}") is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # memory_utils says where the name moved
            importlib.import_module(f"hasten.{module}")


def test_compat_records_name_only_accelerate_names():
    known = set(NAMES["utils"]) | set(NAMES["top_level"]) | set(NAMES["top_level_modules"])
    assert not set(REFUSED) - known and not set(DIFFERENT) - known and not set(BIG_MODEL) - known
    assert not set(REFUSED) & set(DIFFERENT)


@needs_accelerate
def test_checked_in_name_list_matches_the_installed_accelerate():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import accelerate_names
    finally:
        sys.path.pop(0)
    root = os.path.dirname(accelerate.__file__)
    assert accelerate_names.imported_names(os.path.join(root, "utils", "__init__.py")) == NAMES["utils"]
    assert accelerate_names.imported_names(os.path.join(root, "__init__.py")) == NAMES["top_level"]
    assert accelerate_names.modules(root) == NAMES["top_level_modules"]
    # and every name dir() shows is in the list (the list also has the conditional imports)
    shown = {n for n in dir(accelerate.utils) if not n.startswith("_")
             and not type(getattr(accelerate.utils, n)).__name__ == "module"}
    assert shown <= set(NAMES["utils"])


def test_new_names_keep_import_cheap():
    code = ("import sys\nfrom hasten.utils import (MegatronLMPlugin, BnbQuantizationConfig, is_torch_version, "
            "compare_versions, str_to_bool, SAFE_WEIGHTS_NAME, get_int_from_env, ComputeEnvironment)\n"
            "from hasten import prepare_pippy\n"
            "assert is_torch_version('>=', '2.0')\n"
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr + done.stdout


# -- refused names ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_names_raise_a_clear_error_on_use(name):
    where = hasten if name in TOP_LEVEL_ONLY else hasten.utils
    placeholder = getattr(where, name)  # importing works: scripts load
    assert getattr(where, name) is placeholder
    with pytest.raises(FeatureNotAvailableError) as caught:
        placeholder(nn.Linear(1, 1))
    assert str(caught.value) == f"{name} is not available in hasten: {REFUSED[name]}"
    assert isinstance(caught.value, NotImplementedError)
    if name[0].isupper() and name != "rich":
        assert isinstance(placeholder, type)


def test_refusals_name_the_alternative():
    assert "ParallelismConfig(tp_size=...)" in REFUSED["megatron_lm_initialize"]
    assert "MegatronLMPlugin" not in REFUSED  # mapped onto ParallelismConfig (tests/test_megatron_mapping.py)
    assert "CPU" in REFUSED["load_and_quantize_model"] and "torchao" in REFUSED["load_and_quantize_model"]
    with pytest.raises(FeatureNotAvailableError, match="tensor parallelism"):
        hasten.utils.megatron_lm_initialize()


# -- the compatibility table ----------------------------------------------------------------------
def test_the_committed_compatibility_table_is_current():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compat_table.py")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with open(os.path.join(ROOT, "docs", "compatibility.md")) as f:
        committed = f.read()
    assert done.stdout == committed, "run: python tools/compat_table.py > docs/compatibility.md"
    for name, why in REFUSED.items():
        assert f"| `{name}` | refused | {why} |" in committed


# -- the names the issue lists first --------------------------------------------------------------
class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def test_is_compiled_module():
    model = nn.Linear(2, 2)
    compiled = torch.compile(model, backend="eager")
    assert hasten.utils.is_compiled_module(compiled) and not hasten.utils.is_compiled_module(model)
    if SAME_ACCELERATE:
        for m in (model, compiled):
            assert hasten.utils.is_compiled_module(m) == accelerate.utils.is_compiled_module(m)


def test_extract_model_from_parallel():
    extract = hasten.utils.extract_model_from_parallel
    inner = Blocks()
    wrapped = nn.DataParallel(nn.DataParallel(inner))
    assert extract(wrapped) is inner
    compiled = torch.compile(nn.DataParallel(inner), backend="eager")
    kept = extract(compiled)
    assert kept is compiled and kept._orig_mod is inner
    assert extract(torch.compile(nn.DataParallel(inner), backend="eager"), keep_torch_compile=False) is inner
    outer = Blocks()
    outer.layers[1] = nn.DataParallel(outer.layers[1])
    assert extract(outer, recursive=True).layers[1].__class__ is nn.Linear
    if SAME_ACCELERATE:
        for model, kwargs in ((nn.DataParallel(nn.DataParallel(inner)), {}),
                              (torch.compile(nn.DataParallel(inner), backend="eager"), {"keep_torch_compile": False})):
            assert extract(model, **kwargs) is accelerate.utils.extract_model_from_parallel(model, **kwargs)


def test_extract_model_from_parallel_removes_the_mixed_precision_forward(fresh_state):
    acc = hasten.Accelerator(cpu=True, mixed_precision="bf16")
    from hasten.precision import AutocastRegion

    model = acc.prepare(nn.Linear(2, 2))
    assert AutocastRegion.of(model) is not None  # the autocast region prepare attached
    plain = hasten.utils.extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert AutocastRegion.of(plain) is None and "forward" not in plain.__dict__
    x = torch.randn(3, 2, device=acc.device)
    torch.testing.assert_close(plain(x), nn.functional.linear(x, plain.weight, plain.bias), rtol=0, atol=0)


def test_compile_regions_gives_the_eager_outputs():
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(5, 4)
    expected = model(x)
    keys = list(model.state_dict())
    result = hasten.utils.compile_regions(model, backend="eager")
    assert result is model and list(model.state_dict()) == keys  # in place: no `_orig_mod.` in the keys
    assert hasten.utils.has_compiled_regions(model)
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    if SAME_ACCELERATE:
        same = Blocks()
        same.load_state_dict(model.state_dict())
        theirs = accelerate.utils.compile_regions(same, backend="eager")  # a copy whose keys hold `_orig_mod.`
        torch.testing.assert_close(theirs(x), expected, rtol=0, atol=0)
        assert accelerate.utils.has_compiled_regions(theirs) and hasten.utils.has_compiled_regions(theirs)


def test_torch_tensor_parallel_plugin_becomes_a_parallelism_config(fresh_state):
    plugin = hasten.utils.TorchTensorParallelPlugin(tp_size=1)
    with pytest.warns(FutureWarning, match="ParallelismConfig"):
        acc = hasten.Accelerator(cpu=True, torch_tp_plugin=plugin)
    assert acc.parallelism_config.tp_size == 1
    with pytest.raises(ValueError, match="tp_size=0"):
        hasten.utils.TorchTensorParallelPlugin(tp_size=0)
    with pytest.raises(ValueError, match="torch_device_mesh"):
        hasten.utils.TorchTensorParallelPlugin(tp_size=2, torch_device_mesh=object())
    if SAME_ACCELERATE:
        assert vars(hasten.utils.TorchTensorParallelPlugin(tp_size=4)) == \
            vars(accelerate.utils.TorchTensorParallelPlugin(tp_size=4))


def test_torch_context_parallel_config(monkeypatch):
    config = hasten.utils.TorchContextParallelConfig
    assert config().cp_comm_strategy == "allgather"
    assert config("alltoall").cp_comm_strategy == "alltoall"
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    assert config().cp_comm_strategy == "alltoall"
    with pytest.raises(ValueError, match="^Invalid cp_comm_strategy: ring .*use one of"):
        config("ring")
    if SAME_ACCELERATE:
        assert vars(config()) == vars(accelerate.utils.TorchContextParallelConfig())
    handler = hasten.utils.ParallelismConfig(cp_handler=config("alltoall")).cp_handler
    from hasten.strategies.context_parallel import comm_strategy
    assert comm_strategy(handler) == "alltoall"


@pytest.mark.parametrize("operation", [">", ">=", "==", "!=", "<=", "<"])
@pytest.mark.parametrize("version", ["1.0", "2.0.0", torch.__version__, "2.13", "99.0"])
def test_is_torch_version(operation, version):
    from packaging.version import parse

    import operator
    expected = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le,
                "<": operator.lt}[operation](parse(torch.__version__), parse(version))
    assert hasten.utils.is_torch_version(operation, version) == expected
    if SAME_ACCELERATE:
        assert expected == accelerate.utils.is_torch_version(operation, version)


def test_compare_versions():
    from packaging.version import Version

    assert hasten.utils.compare_versions("torch", ">=", "2.0")
    assert hasten.utils.compare_versions(Version("1.2.3"), "<", "1.10")
    assert hasten.utils.compare_versions(torch, "==", torch.__version__)
    with pytest.raises(ValueError, match="operation='=>'"):
        hasten.utils.compare_versions("torch", "=>", "2.0")


def test_str_to_bool_and_env_readers(monkeypatch):
    u = hasten.utils
    assert u.str_to_bool("YES") == 1 and u.str_to_bool("off", to_bool=True) is False
    with pytest.raises(ValueError, match="'maybe'"):
        u.str_to_bool("maybe")
    monkeypatch.setenv("HASTEN_TEST_A", "-1")
    monkeypatch.setenv("HASTEN_TEST_B", "7")
    assert u.get_int_from_env(["HASTEN_TEST_A", "HASTEN_TEST_B"], 3) == 7
    assert u.get_int_from_env(["HASTEN_TEST_NONE"], 3) == 3
    monkeypatch.setenv("HASTEN_TEST_FLAG", "true")
    assert u.parse_flag_from_env("HASTEN_TEST_FLAG") and not u.parse_flag_from_env("HASTEN_TEST_NONE")
    assert u.parse_choice_from_env("HASTEN_TEST_NONE", "fp16") == "fp16"
    assert u.convert_dict_to_env_variables({"A": "1", "B": "x y", "C": ""}) == ["A=1\n"]


def test_purge_accelerate_environment_puts_variables_back(monkeypatch):
    monkeypatch.setenv("HASTEN_KEEP", "1")

    @hasten.utils.purge_accelerate_environment
    def sets_some() -> str:
        os.environ["HASTEN_NEW"] = "x"
        os.environ["ACCELERATE_NEW"] = "y"
        os.environ["HASTEN_KEEP"] = "2"
        return "done"

    assert sets_some() == "done"
    assert "HASTEN_NEW" not in os.environ and "ACCELERATE_NEW" not in os.environ
    assert os.environ["HASTEN_KEEP"] == "1"


def test_tensor_information_round_trip():
    u = hasten.utils
    batch = {"x": torch.zeros(2, 3), "y": [torch.ones(4, dtype=torch.int64)]}
    layout = u.get_data_structure(batch)
    assert layout["x"] == u.TensorInformation(torch.Size([2, 3]), torch.float32)
    rebuilt = u.initialize_tensors(layout)
    assert rebuilt["x"].shape == (2, 3) and rebuilt["y"][0].dtype == torch.int64
    if SAME_ACCELERATE:
        for size, procs in ((3, 4), (5, 2), (8, 3), (1, 2), (7, 7)):
            t = torch.arange(size * 2.0).reshape(size, 2)
            torch.testing.assert_close(u.pad_input_tensors(t, size, procs),
                                       accelerate.utils.pad_input_tensors(t, size, procs), rtol=0, atol=0)


def test_small_helpers_agree_with_accelerate():
    u = hasten.utils
    assert u.convert_bytes(1536) == "1.5 KB" and u.merge_dicts({"a": {"b": 1}}, {"a": {"c": 2}}) == {"a": {"b": 1, "c": 2}}
    model = Blocks()
    assert u.recursive_getattr(model, "layers.1") is model.layers[1]
    assert u.get_module_children_bottom_up(model)[-1] is model
    assert u.SAFE_WEIGHTS_NAME == "model.safetensors" and u.WEIGHTS_NAME == "pytorch_model.bin"
    if SAME_ACCELERATE:
        au = accelerate.utils
        assert u.get_module_children_bottom_up(model, True) == au.get_module_children_bottom_up(model, True)
        assert u.get_pretty_name(model) == au.get_pretty_name(model) and u.get_pretty_name(Blocks) == au.get_pretty_name(Blocks)
        for name in ("SAFE_WEIGHTS_NAME", "WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME", "WEIGHTS_INDEX_NAME", "SCALER_NAME",
                     "TORCH_LAUNCH_PARAMS", "TORCH_DISTRIBUTED_OPERATION_TYPES", "SAFE_WEIGHTS_PATTERN_NAME"):
            assert getattr(u, name) == getattr(au, name), name
        for kind in ("ComputeEnvironment", "SageMakerDistributedType", "CustomDtype"):
            assert {m.name: m.value for m in getattr(u, kind)} == {m.name: m.value for m in getattr(au, kind)}
        assert u.filter_first_and_last_linear_layers(model, "layers.0") == \
            au.filter_first_and_last_linear_layers(model, "layers.0")


def test_load_refuses_arbitrary_pickles(tmp_path):
    path = tmp_path / "t.pt"
    torch.save({"w": torch.ones(2)}, path)
    assert torch.equal(hasten.utils.load(path)["w"], torch.ones(2))
    with pytest.raises(ValueError, match=r"weights_only=False\) is refused"):
        hasten.utils.load(path, weights_only=False)
