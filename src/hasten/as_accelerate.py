"""Run a library built on Accelerate (transformers' ``Trainer``, TRL, ...) on hasten without editing it.

``hasten.install_as_accelerate()``, called before that library is imported, makes ``import accelerate``
and ``import accelerate.<submodule>`` give hasten's modules (``accelerate.utils.memory`` is
``hasten.utils.memory``: the same module object, so singletons such as ``AcceleratorState`` and
``isinstance`` checks are shared), and answers the installed-package questions libraries ask before
importing it: ``importlib.util.find_spec("accelerate")`` and ``importlib.metadata.version("accelerate")``
(hasten's package version, which states the Accelerate API level, e.g. ``1.15.0.post100``).

Only Python's documented extension points are used: a finder/loader on ``sys.meta_path`` and a
``DistributionFinder`` for ``importlib.metadata``; no function of another library is replaced. It is off
until asked for, and asking twice changes nothing.

Without a code change: ``HASTEN_AS_ACCELERATE=1 hasten launch ... script.py`` (every process installs the
alias before the script starts) or ``python -m hasten.as_accelerate script.py [args]`` for one process.

Torch-free: installing imports nothing but the standard library and hasten's package root.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import sys
from typing import Any, Iterable, Optional

ALIAS = "accelerate"
TARGET = "hasten"
ENV_VAR = "HASTEN_AS_ACCELERATE"


class AliasLoader(importlib.abc.Loader):
    """Hands out hasten's module for an ``accelerate`` name: importing the alias imports the real module once."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        """Nothing to run (``create_module`` returned an imported module), only the module's own spec to
        put back: the import system keeps an existing ``__name__``, ``__file__`` and ``__loader__`` but always
        sets ``__spec__``. hasten's modules stay hasten's (pickles, logging names, relative imports)."""
        module.__spec__ = self._own_spec


class AcceleratePackage(importlib.metadata.Distribution):
    """The ``accelerate`` distribution as ``importlib.metadata`` sees it while the alias is on."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename in ("METADATA", "PKG-INFO"):
            from . import __version__

            return (f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {__version__}\n"
                    f"Summary: served by hasten (hasten.install_as_accelerate)\n")
        return None

    def locate_file(self, path: Any) -> pathlib.Path:
        return pathlib.Path(os.path.dirname(os.path.abspath(__file__))) / str(path)


def _normalized(name: Optional[str]) -> Optional[str]:
    return None if name is None else name.replace("-", "_").replace(".", "_").lower()


class AccelerateAlias(importlib.metadata.DistributionFinder):
    """The ``sys.meta_path`` entry: finds ``accelerate[.x.y]`` as ``hasten[.x.y]``, and the ``accelerate``
    distribution for ``importlib.metadata``. It goes first, ahead of the real package if one is installed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS):]
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError:  # a parent that hasten does not have
            return None
        if found is None:
            return None  # then "No module named 'accelerate.x'", as without the alias
        spec = importlib.machinery.ModuleSpec(fullname, AliasLoader(real), origin=found.origin,
                                              is_package=found.submodule_search_locations is not None)
        return spec

    def find_distributions(self, context: Any = None) -> Iterable[importlib.metadata.Distribution]:
        if context is None:
            context = importlib.metadata.DistributionFinder.Context()
        if list(context.path) != list(sys.path):
            return  # a search of given folders (not this process's imports): the real files answer
        if context.name is None or _normalized(context.name) == ALIAS:
            yield AcceleratePackage()

    def invalidate_caches(self) -> None:
        """Nothing cached."""


def is_installed() -> bool:
    """Whether ``install_as_accelerate()`` is in effect in this process."""
    return any(isinstance(finder, AccelerateAlias) for finder in sys.meta_path)


def install_as_accelerate() -> None:
    """Make ``import accelerate`` (and its submodules, and its package metadata) resolve to hasten.

    Call it before importing a library built on Accelerate. Calling it again does nothing. It also sets
    ``HASTEN_AS_ACCELERATE=1`` (unless set) so that processes ``hasten launch`` starts from here get it. Raises
    ``RuntimeError`` if the real ``accelerate`` is already imported in this process (its objects would mix
    with hasten's).
    """
    if is_installed():
        return
    loaded = sorted(name for name, module in sys.modules.items()
                    if (name == ALIAS or name.startswith(ALIAS + ".")) and module is not None
                    and not getattr(module, "__name__", "").startswith(TARGET))
    if loaded:
        raise RuntimeError(
            f"install_as_accelerate(): the real accelerate is already imported ({loaded[0]} from "
            f"{getattr(sys.modules[loaded[0]], '__file__', '?')}); call it before anything imports accelerate "
            f"(first thing in the script, or HASTEN_AS_ACCELERATE=1 hasten launch ...)")
    sys.meta_path.insert(0, AccelerateAlias())
    importlib.invalidate_caches()
    # Processes that `hasten launch` starts from here (a library's own launch, e.g. a CLI that calls
    # accelerate.commands.launch.launch_command) get the alias too: the launcher's bootstrap reads this.
    os.environ.setdefault(ENV_VAR, "1")


def _run(argv: list) -> None:
    """``python -m hasten.as_accelerate [-m] script.py [args]``: the script (or module) with the alias on."""
    import runpy

    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m hasten.as_accelerate [-m] script.py-or-module [args...]")
    install_as_accelerate()
    sys.argv = list(argv)
    if module:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))  # as `python script.py` would have it
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    # Through the package's module, so that its finder is the one ``is_installed`` and the library see.
    from hasten.as_accelerate import _run as _package_run

    _package_run(sys.argv[1:])
