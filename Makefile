# Set-up is part of each target: `make train` or `make test` on a fresh machine does everything.
PY ?= python3
NPROC ?= 2

.PHONY: install train test bench
install: .install-stamp

# torch is installed first and on its own so that the package's `torch>=2.4` is already met:
# on the CI/dev machines `torch==2.13.0` resolves to a local CPU wheel, never to CUDA wheels.
.install-stamp: pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[test]'
	touch $@

train: .install-stamp
	hasten launch --cpu --num_processes $(NPROC) examples/train.py

test: .install-stamp
	$(PY) -m pytest -q

bench: .install-stamp
	$(PY) bench/overhead.py
