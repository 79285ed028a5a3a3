"""The two ways the README installs hasten (it is not on a package index): from a clone, and from a
wheel built from it; each into a fresh venv that sees only what hasten declares.

The venv has no system site packages. It sees the distributions hasten's ``[project]
dependencies`` name and theirs in turn (torch, numpy, ..., resolved as pip would), linked from this
interpreter's environment, so nothing is downloaded and no torch is installed again. The build sees
only ``[build-system] requires`` (and what they require). A package the core imports but does not
declare is then missing, as on a fresh machine: the wheel's venv imports every module under
``hasten``. The installed package (the wheel's copy, or the clone for ``pip install -e``), not this
source tree, must answer."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10: pip's own copy of the same parser
    from pip._vendor import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What legitimately needs an optional package on a core install: a module (its import) or a
# ``module:attribute`` (reading it), mapped to the package its ImportError must name. Decided:
# nothing. Every module imports, and every name in every ``__all__`` resolves, on the core install;
# deepspeed, torchao, transformers, tqdm and the trackers are imported where they are used, and
# those places say what to install.
NEEDS_OPTIONAL: dict[str, str] = {}


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _closure(requirements: list[str], what: str) -> list[metadata.Distribution]:
    """The installed distributions that ``requirements`` need, with their own requirements (markers
    and extras evaluated as pip does); each must be installed here at a version the requirement allows."""
    found: dict[str, metadata.Distribution] = {}
    done: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{what} needs {req}, which this environment does not have: install it (pip install '{req}')")
        assert req.specifier.contains(dist.version, prereleases=True), \
            f"{what} needs {req}; this environment has {dist.version}: pip install '{req}'"
        found[name] = dist
        for wanted in [""] + sorted(req.extras):
            if (name, wanted) in done:
                continue
            done.add((name, wanted))
            todo += [(Requirement(r), wanted) for r in dist.requires or ()]
    return list(found.values())


def _link(dists: list[metadata.Distribution], folder: str) -> str:
    """A folder of links to the files of ``dists`` (packages, modules, their .dist-info), nothing
    else; a namespace folder several distributions share (``nvidia/``) is made and linked into."""
    os.makedirs(folder)
    for dist in dists:
        base = dist.locate_file("")
        if dist.files is None:  # no RECORD (a distro's package): its top-level names and metadata folder
            parts = {(name,) for name in (dist.read_text("top_level.txt") or "").split()}
            parts.add((os.path.basename(str(dist._path)),))  # noqa: SLF001 - the .dist-info folder itself
        else:
            parts = {f.parts[:2] for f in dist.files if f.parts[0] != ".." and not f.parts[0].endswith(".pth")}
        for part in sorted(parts):
            top = os.path.join(str(base), part[0])
            if os.path.isdir(top) and len(part) == 2 and not os.path.exists(os.path.join(top, "__init__.py")) \
                    and not part[0].endswith((".dist-info", ".libs", ".data")):
                os.makedirs(os.path.join(folder, part[0]), exist_ok=True)
                source, target = os.path.join(top, part[1]), os.path.join(folder, *part)
            else:
                source, target = top, os.path.join(folder, part[0])
            if os.path.exists(source) and not os.path.lexists(target):
                os.symlink(source, target)
    return folder


@pytest.fixture(scope="module")
def links(tmp_path_factory):
    """Two folders: what the build may see, what the installed package may see."""
    root = tmp_path_factory.mktemp("declared")
    config = _pyproject()
    build = _link(_closure(config["build-system"]["requires"], "building hasten ([build-system] requires)"),
                  str(root / "build"))
    runtime = _link(_closure(config["project"]["dependencies"], "hasten ([project] dependencies)"),
                    str(root / "runtime"))
    return build, runtime


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A clone of this repository holding the working tree's package and build files."""
    clone = tmp_path_factory.mktemp("clone") / "hasten"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", ROOT, str(clone)], check=True, timeout=120)
    shutil.rmtree(clone / "src")
    shutil.copytree(os.path.join(ROOT, "src"), clone / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), clone / "pyproject.toml")
    return clone


def _venv(path, runtime: str) -> str:
    """A venv without system site packages and without pip (this interpreter's pip installs into it
    with ``--python``), whose only other packages are the links in ``runtime``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = sysconfig.get_path("purelib", vars={"base": str(path), "platbase": str(path)})
    with open(os.path.join(site, "hasten_declared_dependencies.pth"), "w") as f:
        f.write(runtime + "\n")
    return os.path.join(str(path), "bin", "python")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def _pip(python: str, *args: str, build: str, cwd) -> None:
    """This interpreter's pip acting on ``python``'s venv, offline; a build runs in that venv with
    only the build requirements added (``--no-build-isolation`` would otherwise take whatever
    setuptools is around: a fresh venv's setuptools 65 without ``wheel`` cannot build a wheel)."""
    done = subprocess.run([sys.executable, "-m", "pip", "--python", python, *args, "-q", "--no-index",
                           "--no-build-isolation"], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=_env(PYTHONPATH=build))
    assert done.returncode == 0, done.stdout + done.stderr


def _ask(python: str, cwd) -> str:
    """Where the venv's hasten lives (asserting that it and its CLI answer)."""
    where = subprocess.run([python, "-c", "import hasten, importlib.metadata; print(hasten.__file__); "
                            "print(hasten.__version__); print(importlib.metadata.version('hasten'))"],
                           capture_output=True, text=True, timeout=120, env=_env(), cwd=cwd)
    assert where.returncode == 0, where.stderr
    # The version scheme (docs/migration.md): the installed metadata says what hasten.__version__ says.
    _, module_version, metadata_version = where.stdout.splitlines()
    assert metadata_version == module_version, (metadata_version, module_version)
    cli = subprocess.run([os.path.join(os.path.dirname(python), "hasten"), "launch", "--help"], capture_output=True,
                         text=True, timeout=60, env=_env(), cwd=cwd)
    assert cli.returncode == 0 and "--num_processes" in cli.stdout, cli.stdout + cli.stderr
    return where.stdout.splitlines()[0]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to make a clean copy of the tree")
@pytest.mark.parametrize("how", ["clone", "wheel"])
def test_install_from_a_clone_and_from_a_built_wheel(how, tmp_path, links, clone):
    build, runtime = links
    python = _venv(tmp_path / "venv", runtime)
    if how == "clone":  # as `make train` and the README do
        _pip(python, "install", "--no-deps", "-e", str(clone), build=build, cwd=tmp_path)
        answers_from = str(clone / "src")  # the clone's tree, not this one
    else:
        _pip(python, "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(clone), build=build, cwd=tmp_path)
        wheels = list((tmp_path / "dist").glob("hasten-*.whl"))
        assert len(wheels) == 1, wheels
        _pip(python, "install", "--no-deps", str(wheels[0]), build=build, cwd=tmp_path)
        answers_from = str(tmp_path / "venv")  # the installed copy, not a tree
    location = _ask(python, cwd=tmp_path)
    assert location.startswith(answers_from), location
    # What hasten declares is there, at versions it allows (and what those need in turn).
    check = subprocess.run([sys.executable, "-m", "pip", "--python", python, "check"], capture_output=True, text=True,
                           timeout=120, env=_env())
    assert check.returncode == 0, check.stdout + check.stderr
    if how == "wheel":
        _assert_every_module_imports(python, cwd=tmp_path)


def _assert_every_module_imports(python: str, cwd) -> None:
    """Every module of the installed wheel imports, and every name in its ``__all__`` resolves, with
    nothing but hasten's declared dependencies; what NEEDS_OPTIONAL lists fails with an ImportError
    that names the package to install."""
    script = os.path.join(ROOT, "tests", "scripts", "import_every_module.py")
    probes = [name for name in NEEDS_OPTIONAL if ":" in name]
    done = subprocess.run([python, script, *probes], capture_output=True, text=True, timeout=300, env=_env(), cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["modules"] > 100, report  # the walk found the package's modules
    failed = report["failed"]
    unexpected = {name: error for name, error in failed.items() if name not in NEEDS_OPTIONAL}
    assert not unexpected, f"fails on a core install (an undeclared dependency?): {unexpected}"
    for name, package in NEEDS_OPTIONAL.items():
        assert name in failed, f"{name} works without {package}: remove it from NEEDS_OPTIONAL"
        error = failed[name]
        assert error["type"] in ("ImportError", "ModuleNotFoundError") and f"pip install {package}" in error["message"], \
            (name, error)
