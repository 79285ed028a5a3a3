"""The two ways the README installs hasten (it is not on a package index): from a clone, and from a
wheel built from it. Each goes into a fresh venv that sees this machine's torch (so nothing is
downloaded); the installed package, not the source tree, must answer."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _venv(path):
    # Without a pip of its own: this interpreter's pip installs into it (``--python``), with this
    # machine's setuptools as the build backend (a venv's bundled one may be too old to build wheels).
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True,
                   timeout=120)
    return os.path.join(str(path), "bin", "python")


def _install_and_ask(python, target, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-build-isolation", "--force-reinstall",
                    "--no-index", target], check=True, timeout=300, env=env, cwd=cwd)
    where = subprocess.run([python, "-c", "import hasten, importlib.metadata; print(hasten.__file__); "
                            "print(hasten.__version__); print(importlib.metadata.version('hasten'))"],
                           capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    assert where.returncode == 0, where.stderr
    # The version scheme (docs/migration.md): the installed metadata says what hasten.__version__ says.
    _, module_version, metadata_version = where.stdout.splitlines()
    assert metadata_version == module_version, (metadata_version, module_version)
    cli = subprocess.run([os.path.join(os.path.dirname(python), "hasten"), "--help"], capture_output=True,
                         text=True, timeout=60, env=env, cwd=cwd)
    assert cli.returncode == 0 and "launch" in cli.stdout, cli.stdout + cli.stderr
    return where.stdout.splitlines()[0]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to make a clean copy of the tree")
@pytest.mark.parametrize("how", ["clone", "wheel"])
def test_install_from_a_clone_and_from_a_built_wheel(how, tmp_path):
    clone = tmp_path / "hasten"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", ROOT, str(clone)], check=True, timeout=120)
    # The working tree's state, not only what is committed: copy the package and build files over.
    shutil.rmtree(clone / "src")
    shutil.copytree(os.path.join(ROOT, "src"), clone / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), clone / "pyproject.toml")
    python = _venv(tmp_path / "venv")
    if how == "clone":
        target = str(clone)
    else:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(clone)], check=True, timeout=300)
        wheels = list((tmp_path / "dist").glob("hasten-*.whl"))
        assert len(wheels) == 1, wheels
        target = str(wheels[0])
    location = _install_and_ask(python, target, cwd=str(tmp_path))
    assert location.startswith(str(tmp_path / "venv")), location  # the installed copy, not the tree
