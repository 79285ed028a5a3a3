#!/usr/bin/env bash
# Build (once) a small venv with the oldest torch hasten supports, for `make smoke-min`.
#   tools/min_torch_venv.sh VENV TORCH_VERSION
# Only the wheels torch needs to import and train on CPU are installed, each with --no-deps, so pip
# never pulls the nvidia-* CUDA packages (several GB) that torch's Linux wheel depends on; the CUDA
# libraries its own libraries link against are replaced by a stand-in (tools/cuda_stub.py).
set -euo pipefail
venv=$1 version=$2
here=$(cd "$(dirname "$0")" && pwd)
if [ -f "$venv/.ready-$version" ]; then exit 0; fi
rm -rf "$venv"
${PY:-python3} -m venv "$venv"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
pip_q() { "$venv/bin/python" -m pip -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
if ! pip_q download --no-deps -d "$wheels" "torch==$version"; then
    # Say so loudly and let the caller skip the smoke run: a machine without the network or a wheel
    # cache cannot build this venv, and that is not a defect of hasten.
    echo "smoke-min: SKIPPED: torch==$version could not be downloaded (no network and no wheel cache?)" >&2
    exit 3
fi
pip_q install --no-deps "$wheels"/torch-*.whl typing_extensions filelock sympy mpmath networkx jinja2 markupsafe \
    fsspec numpy "safetensors>=0.4" pyyaml packaging
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$venv/bin/python" "$here/cuda_stub.py" "$site/torch/lib"
"$venv/bin/python" -c "import torch; assert not torch.cuda.is_available(); print('min-torch venv:', torch.__version__)"
touch "$venv/.ready-$version"
