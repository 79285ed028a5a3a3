"""Make a CPU-only import of a CUDA build of torch possible, for ``make smoke-min``.

PyPI has CPU-only torch wheels for Linux only from the newest releases on; an older torch comes as the
CUDA build, whose libraries link against the CUDA libraries of the ``nvidia-*`` packages (several GB).
The smoke test of the oldest supported torch runs on CPU and never calls into CUDA, so this writes one
small stand-in library that defines every CUDA symbol torch's libraries name (each returns 100,
``cudaErrorNoDevice``: torch then sees no GPU) and copies it into ``torch/lib`` under each missing
library's name, where torch's RPATH (``$ORIGIN``) finds it. Needs ``nm`` and a C compiler.

    python tools/cuda_stub.py VENV/lib/pythonX.Y/site-packages/torch/lib
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile

# The CUDA libraries that torch's own libraries need (DT_NEEDED) and nothing on a CPU machine provides.
_CUDA_LIB = re.compile(r"^lib(cudart|cublas|cublasLt|cudnn|cufft|cupti|cusolver|cusparse|cusparseLt|curand|nccl|"
                       r"nvrtc|nvJitLink|cuda|nvToolsExt|cufile)\.so(\.\d+)*$")
# Unversioned symbols that come from those libraries (the versioned ones name their library).
_CUDA_SYMBOL = re.compile(r"^(nccl|curand|cusparseLt|cuda|cublas|cudnn|cufft|cusolver|cusparse|cupti|nvrtc|"
                          r"nvJitLink|nvtx|cuFile|cu[A-Z]|__cuda)")


def _output(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def missing_libraries(lib_dir: str) -> set[str]:
    """The CUDA libraries torch's libraries need that the dynamic loader cannot find."""
    missing = set()
    for path in glob.glob(os.path.join(lib_dir, "*.so*")):
        for line in _output("ldd", path).splitlines():
            name = line.split("=>")[0].strip()
            if "not found" in line and _CUDA_LIB.match(name):
                missing.add(name)
    return missing


def stub_sources(lib_dir: str, libraries: set[str]) -> tuple[str, str]:
    """The C source and the linker version script of the stand-in library."""
    versioned: dict[str, set[str]] = {}
    plain: set[str] = set()
    for path in glob.glob(os.path.join(lib_dir, "*.so*")):
        for line in _output("nm", "-D", "--undefined-only", path).split("\n"):
            symbol = line.split()[-1] if line.split() else ""
            name, _, version = symbol.partition("@")
            if version in libraries:
                versioned.setdefault(version, set()).add(name)
            elif not version and _CUDA_SYMBOL.match(name):
                plain.add(name)
    everything = sorted(plain.union(*versioned.values()))
    source = "".join(f"int {name}(void) {{ return 100; }}\n" for name in everything)
    script = "".join(f"{version} {{ global: {' '.join(f'{n};' for n in sorted(names))} }};\n"
                     for version, names in sorted(versioned.items()))
    script += f"STUB {{ global: {' '.join(f'{n};' for n in sorted(plain))} local: *; }};\n"
    return source, script


def main(lib_dir: str) -> int:
    libraries = missing_libraries(lib_dir)
    if not libraries:
        print(f"cuda_stub: {lib_dir} needs no CUDA library that is missing")
        return 0
    source, script = stub_sources(lib_dir, libraries)
    with tempfile.TemporaryDirectory() as work:
        c_file, map_file, built = (os.path.join(work, n) for n in ("stub.c", "stub.map", "libcudastub.so"))
        with open(c_file, "w") as f:
            f.write(source)
        with open(map_file, "w") as f:
            f.write(script)
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", built, c_file,
                        f"-Wl,--version-script={map_file}"], check=True)
        data = open(built, "rb").read()
    for name in sorted(libraries):  # copies, not links: the loader must see distinct libraries
        with open(os.path.join(lib_dir, name), "wb") as f:
            f.write(data)
    print(f"cuda_stub: {len(libraries)} stand-in CUDA libraries in {lib_dir}: {', '.join(sorted(libraries))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
