"""Import every module under ``hasten`` and read every name each one exports (``__all__``: what
``from module import *`` reads, and it resolves the lazy exports). Run by tests/test_install.py
inside a venv that holds only what hasten declares. The arguments are names expected to need an
optional package (``module:attribute``), each read on its own. Prints one JSON
object: how many modules, and for each failure its exception type and message."""

import importlib
import json
import pkgutil
import sys
import warnings

warnings.simplefilter("ignore")  # the kept-for-old-imports modules warn when imported; not a failure

import hasten  # noqa: E402

failed = {}
names = ["hasten"] + [info.name for info in pkgutil.walk_packages(hasten.__path__, "hasten.")]
for name in names:
    try:
        module = importlib.import_module(name)
        for attribute in getattr(module, "__all__", ()):
            getattr(module, attribute)
    except BaseException as e:  # noqa: BLE001 - report every failure, whatever it is
        failed[name] = {"type": type(e).__name__, "message": str(e)}

for name in sys.argv[1:]:
    module, _, attribute = name.partition(":")
    try:
        getattr(importlib.import_module(module), attribute)
    except BaseException as e:  # noqa: BLE001
        failed[name] = {"type": type(e).__name__, "message": str(e)}

print(json.dumps({"modules": len(names), "failed": failed}))
