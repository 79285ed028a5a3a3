"""hasten.test_utils: Accelerate's test helpers, answered by hasten (issue 26, item 1)."""

import ast
import importlib.util
import os
import subprocess
import sys
import unittest

import pytest

from devices import launch_flags


def _run_case(case_class: type) -> unittest.TestResult:
    """Run every test of ``case_class`` with unittest's runner (as pytest would) and return the result."""
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case_class).run(result)
    return result


def _accelerate_file(*parts: str) -> str:
    spec = importlib.util.find_spec("accelerate")
    if spec is None:
        pytest.skip("accelerate is not installed: nothing to compare the names with")
    return os.path.join(os.path.dirname(spec.origin), *parts)


def _public_names(path: str) -> set:
    """The names Accelerate's module at ``path`` imports from its submodules or defines (read, not imported)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper())
    return names


def test_accelerates_public_names_exist():
    import hasten.test_utils as tu
    import hasten.test_utils.testing as testing
    import hasten.test_utils.training as training

    missing = sorted(n for n in _public_names(_accelerate_file("test_utils", "__init__.py")) if not hasattr(tu, n))
    assert not missing, f"hasten.test_utils lacks {missing}"
    # testing.py's own helpers (get_backend, the imports of accelerate.utils aside) and training.py's classes.
    wanted = _public_names(_accelerate_file("test_utils", "testing.py")) - {"mock", "partial", "contextmanager"}
    missing = sorted(n for n in wanted if n.startswith(("require_", "get_", "path_", "run_", "DEFAULT", "Temp",
                                                        "Accelerate", "Mocking", "assert_", "capture_", "execute_",
                                                        "skip", "slow", "are_", "parse_", "pytest_", "Subprocess"))
                     and not hasattr(testing, n))
    assert not missing, f"hasten.test_utils.testing lacks {missing}"
    assert {"RegressionDataset", "RegressionModel"} <= {n for n in dir(training)}
    for name in ("test_script", "test_sync", "test_ops"):
        assert callable(getattr(tu, name).main)


def test_import_hasten_does_not_load_test_utils():
    code = "import sys, hasten; assert 'hasten.test_utils' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_path_helpers_point_into_hasten():
    import hasten
    from hasten.test_utils import path_in_accelerate_package, path_in_hasten_package

    package = os.path.dirname(os.path.abspath(hasten.__file__))
    script = path_in_hasten_package("test_utils", "scripts", "test_script.py")
    assert str(script) == os.path.join(package, "test_utils", "scripts", "test_script.py") and script.is_file()
    assert path_in_accelerate_package("test_utils") == path_in_hasten_package("test_utils")
    for name in ("test_sync.py", "test_ops.py", "test_cli.py"):
        assert path_in_hasten_package("test_utils", "scripts", name).is_file()


def test_regression_model_trains():
    import torch
    from torch.utils.data import DataLoader

    from hasten import Accelerator
    from hasten.test_utils import RegressionDataset, RegressionModel
    from hasten.test_utils.training import RegressionModel4XPU

    from distributed import reset_state

    reset_state()
    acc = Accelerator()
    data = RegressionDataset(a=2, b=3, length=64, seed=0)
    assert len(data) == 64 and set(data[0]) == {"x", "y"}
    model = RegressionModel()
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.3), DataLoader(data, batch_size=32))
    for _ in range(15):
        for batch in loader:
            acc.backward(torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]))
            opt.step()
            opt.zero_grad()
    trained = acc.unwrap_model(model)
    assert abs(trained.a.item() - 2) < 0.1 and abs(trained.b.item() - 3) < 0.1, (trained.a.item(), trained.b.item())
    xpu_model = RegressionModel4XPU(a=2, b=3)
    assert torch.allclose(xpu_model(torch.ones(2)), torch.full((2,), 5.0))
    reset_state()


def test_require_decorators_skip_as_the_machine_and_hasten_say():
    from hasten.test_utils import testing as t

    class Cases(unittest.TestCase):
        @t.require_tpu
        def test_tpu(self):
            pass

        @t.require_cpu
        def test_cpu(self):
            pass

        @t.require_non_cpu
        def test_non_cpu(self):
            pass

        @t.require_torch_min_version(version="1.0")
        def test_old_torch(self):
            pass

        @t.require_torch_min_version(version="999.0")
        def test_future_torch(self):
            pass

        @t.require_transformers
        def test_transformers(self):
            pass

        @t.require_non_torch_xla
        def test_no_xla(self):
            pass

        @t.skip
        def test_skipped(self):
            pass

    result = _run_case(Cases)
    skipped = {case._testMethodName: reason for case, reason in result.skipped}
    assert not result.failures and not result.errors
    assert "hasten does not support" in skipped["test_tpu"]
    # require_cpu and require_non_cpu follow the machine: exactly one of them skips.
    assert ("test_cpu" in skipped) != ("test_non_cpu" in skipped)
    assert ("test_non_cpu" in skipped) == (t.torch_device == "cpu")  # cpu-on-purpose: the decorator's own rule
    assert "test_old_torch" not in skipped and "999.0" in skipped["test_future_torch"]
    assert ("test_transformers" in skipped) == (importlib.util.find_spec("transformers") is None)
    assert "test_no_xla" not in skipped and "test_skipped" in skipped
    with pytest.raises(ValueError, match="version="):
        t.require_torch_min_version(lambda: None)


def test_purge_covers_subclasses_and_inherited_tests(monkeypatch):
    # Only hasten.utils here, so this test also runs against a hasten without test_utils.
    from hasten.utils import purge_accelerate_environment

    monkeypatch.delenv("ACCELERATE_LEAK", raising=False)
    monkeypatch.setenv("HASTEN_KEPT", "before")

    @purge_accelerate_environment
    class Base(unittest.TestCase):
        def test_base_sets(self):
            os.environ["ACCELERATE_LEAK"] = "base"

    class Child(Base):
        def test_child_sets(self):
            os.environ["ACCELERATE_LEAK"] = "child"
            os.environ["HASTEN_KEPT"] = "changed"

        def test_child_sees_nothing(self):
            assert "ACCELERATE_LEAK" not in os.environ and os.environ["HASTEN_KEPT"] == "before"

    class Plain(unittest.TestCase):
        def test_inherited_sets(self):
            os.environ["ACCELERATE_LEAK"] = "inherited"

    @purge_accelerate_environment
    class DecoratedChildOfPlain(Plain):
        pass

    for case in (Base, Child, DecoratedChildOfPlain):
        result = _run_case(case)
        assert result.wasSuccessful(), result.failures + result.errors
        assert "ACCELERATE_LEAK" not in os.environ, f"{case.__name__} leaked {os.environ['ACCELERATE_LEAK']}"
        assert os.environ["HASTEN_KEPT"] == "before"


def test_accelerate_test_case_restores_environment_and_state(monkeypatch):
    from hasten import Accelerator
    from hasten.state import AcceleratorState
    from hasten.test_utils.testing import AccelerateTestCase

    monkeypatch.delenv("HASTEN_MIXED_PRECISION", raising=False)

    class NoSuperSetUp(AccelerateTestCase):
        def setUp(self):  # forgets super().setUp(): the environment must be restored anyway
            os.environ["HASTEN_MIXED_PRECISION"] = "bf16"

        def test_builds_accelerator(self):
            Accelerator()

    result = _run_case(NoSuperSetUp)
    assert result.wasSuccessful(), result.failures + result.errors
    assert "HASTEN_MIXED_PRECISION" not in os.environ
    assert not AcceleratorState._shared_state, "the accelerator state outlived the test"


def test_assert_exception_and_capture_call_output():
    from hasten.test_utils import assert_exception, capture_call_output

    with assert_exception(ValueError, "bad"):
        raise ValueError("a bad value")
    with pytest.raises(AssertionError, match="ran without issue"):
        with assert_exception(ValueError):
            pass
    with pytest.raises(AssertionError, match="Expected exception of type"):
        with assert_exception(ValueError):
            raise KeyError("x")
    assert capture_call_output(print, "hello", "there") == "hello there\n"


def test_get_launch_command_runs_the_test_scripts_on_two_processes(tmp_path):
    from hasten.test_utils import execute_subprocess_async, get_launch_command, path_in_hasten_package

    assert get_launch_command(num_processes=2, cpu=True, debug=False, mixed_precision=None, monitor_interval=0.1) == [
        "hasten", "launch", "--num_processes=2", "--cpu", "--monitor_interval=0.1"]
    # One launch runs the three scripts Accelerate's suite launches most (one start-up, not three).
    script = tmp_path / "all_scripts.py"
    script.write_text("from hasten.test_utils import test_ops, test_script, test_sync\n"
                      "test_script.main()\ntest_sync.main()\ntest_ops.main()\n")
    flags = {flag.lstrip("-"): True for flag in launch_flags(2)}
    result = execute_subprocess_async(get_launch_command(num_processes=2, **flags) + [script],
                                      env=os.environ.copy(), timeout=300, quiet=True, echo=False)
    out = "\n".join(result.stdout)
    for line in ("training_check: ok on 2 process(es)", "accumulate: ok on 2 process(es)",
                 "check_reduce: ok on 2 process(es)"):
        assert line in out, out
    assert path_in_hasten_package("test_utils", "scripts", "test_cli.py").is_file()
    with pytest.raises(RuntimeError, match="failed with returncode 3"):
        execute_subprocess_async([sys.executable, "-c", "import sys; sys.exit(3)"], quiet=True, echo=False)


def test_compare_against_test_finds_missing_feature_lines(tmp_path, monkeypatch):
    from hasten.test_utils.examples import compare_against_test

    def script(name, body):
        path = tmp_path / "examples" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text("def training_function(config):\n" + body + "    return 0\n\ndef main():\n    pass\n")
        return str(path)

    monkeypatch.chdir(tmp_path)
    script("nlp_example.py", "    model = build()\n")
    feature = script("feature.py", "    model = build()\n    accelerator.save_state('x')\n")
    complete = script("complete.py", "    model = build()\n")
    assert compare_against_test(complete, feature, parser_only=False) == ["    accelerator.save_state('x')\n"]
    script("complete.py", "    model = build()\n    accelerator.save_state('x')\n")
    assert compare_against_test(complete, feature, parser_only=False) == []
