"""The version scheme: hasten's package version states the Accelerate API level it implements, so a
script's version gates (written against ``accelerate.__version__``, read as ``hasten.__version__`` after
the word replacement) take Accelerate 1.15's branch; hasten's own release stays readable."""

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest
from packaging import version
from packaging.specifiers import SpecifierSet

import hasten
from hasten.utils.versions import compare_versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE = version.Version("1.15.0")  # the release whose behaviour the gates below must see


@pytest.mark.parametrize("gate", ["0.16.0", "0.20", "0.20.3", "0.27.0", "1.0", "1.0.0", "1.10.1", "1.15", "1.15.0"])
def test_at_least_gates_take_accelerate_115s_branch(gate):
    ours = version.parse(hasten.__version__)
    assert (ours >= version.parse(gate)) == (ACCELERATE >= version.parse(gate)) is True
    assert (version.Version(hasten.__version__) >= version.Version(gate)) is True
    assert compare_versions(hasten, ">=", gate) and compare_versions(hasten.__version__, ">=", gate)
    assert hasten.__version__ in SpecifierSet(f">={gate}")


@pytest.mark.parametrize("gate", ["1.16", "1.16.0", "1.15.1", "2.0"])
def test_below_gates_hold(gate):
    assert version.parse(hasten.__version__) < version.parse(gate)
    assert compare_versions(hasten, "<", gate)
    assert hasten.__version__ in SpecifierSet(f"<{gate}")


def test_the_version_reads_as_accelerate_115_in_every_usual_way():
    parsed = version.parse(hasten.__version__)
    assert parsed.release == (1, 15, 0) and (parsed.major, parsed.minor, parsed.micro) == (1, 15, 0)
    assert parsed.base_version == hasten.__accelerate_version__ == "1.15.0"
    assert parsed.local is None and not parsed.is_prerelease and not parsed.is_devrelease  # an index takes it
    assert hasten.__version__ in SpecifierSet("~=1.15.0") and hasten.__version__ in SpecifierSet(">=1.15,<1.16")
    assert tuple(int(p) for p in hasten.__version__.split(".")[:2]) == (1, 15)  # scripts that split the string


def test_hasten_release_is_the_post_number():
    major, minor, patch = (int(p) for p in hasten.__hasten_version__.split("."))
    assert version.parse(hasten.__version__).post == major * 10000 + minor * 100 + patch
    assert hasten.__version__ == f"{hasten.__accelerate_version__}.post{major * 10000 + minor * 100 + patch}"


def test_pyproject_states_the_same_version():
    # What the installed metadata will say (importlib.metadata.version("hasten")); test_install.py checks
    # the installed copy itself.
    with open(os.path.join(ROOT, "pyproject.toml")) as f:  # a regex, not tomllib: Python 3.10 has none
        assert re.findall(r'^version = "([^"]+)"', f.read(), flags=re.MULTILINE) == [hasten.__version__]


def test_installed_metadata_agrees_when_installed_from_this_tree():
    try:
        dist = importlib.metadata.distribution("hasten")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("hasten is not installed (only on PYTHONPATH)")
    origin = dist.read_text("direct_url.json") or ""
    if ROOT not in origin:
        pytest.skip(f"the installed hasten is another tree's ({origin.strip() or 'not editable'})")
    assert dist.version == hasten.__version__, "reinstall: pip install -e . (pyproject's version changed)"


def test_cli_version_prints_both():
    out = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "--version"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(rf"hasten {re.escape(hasten.__hasten_version__)} \(Accelerate API 1\.15\.0; package version "
                        rf"{re.escape(hasten.__version__)}\)\n", out.stdout), out.stdout
