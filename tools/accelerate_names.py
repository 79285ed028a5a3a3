"""Write tools/accelerate_names.json: the public names of the installed Accelerate.

Run it when moving to a new Accelerate release: ``python tools/accelerate_names.py``. The names are
read from the source (every name ``accelerate/__init__.py`` and ``accelerate/utils/__init__.py``
import, the conditional imports included), not from ``dir()``, so they do not depend on which
optional packages this machine has. The file is checked in, so the tests and the compatibility
table need no Accelerate.
"""

from __future__ import annotations

import ast
import json
import os
import sys

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_names.json")


def imported_names(path: str) -> list[str]:
    """Public names bound by the ``from ... import ...`` statements of ``path``, at any depth."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    return sorted(n for n in names if not n.startswith("_") and n != "*")


def modules(package_dir: str) -> list[str]:
    """Public submodules and subpackages of the package at ``package_dir`` (test helpers left out)."""
    found = set()
    for entry in os.listdir(package_dir):
        if entry.startswith("_") or entry == "test_utils":
            continue
        if entry.endswith(".py") or os.path.isfile(os.path.join(package_dir, entry, "__init__.py")):
            found.add(entry.removesuffix(".py"))
    return sorted(found)


def main() -> int:
    import accelerate

    root = os.path.dirname(accelerate.__file__)
    data = {
        "accelerate_version": accelerate.__version__,
        "top_level": imported_names(os.path.join(root, "__init__.py")),
        "top_level_modules": modules(root),
        "utils": imported_names(os.path.join(root, "utils", "__init__.py")),
    }
    with open(OUT, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(data['top_level'])} top-level names, {len(data['top_level_modules'])} modules, "
          f"{len(data['utils'])} names of accelerate.utils", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
