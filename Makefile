# Set-up is part of each target: `make train` or `make test` on a fresh machine does everything.
# `make train` installs the core only (torch, numpy, safetensors, pyyaml); `make test` adds the
# test extra (transformers, accelerate, deepspeed, torchao, trackers) on top.
PY ?= python3
NPROC ?= 2

.PHONY: install install-test train test bench docs
install: .install-core
install-test: .install-test

# torch is installed first and on its own so that the package's `torch>=2.4` is already met:
# on the CI/dev machines `torch==2.13.0` resolves to a local CPU wheel, never to CUDA wheels.
.install-core: pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $@

.install-test: .install-core pyproject.toml
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[test]'
	touch $@

train: .install-core
	hasten launch --cpu --num_processes $(NPROC) examples/train.py

test: .install-test
	$(PY) -m pytest -q

bench: .install-core
	$(PY) bench/overhead.py

# The API reference, from the docstrings: open site/api/index.html.
docs: .install-core
	$(PY) -m pip install -q -e '.[docs]'
	$(PY) -m pdoc -o site/api hasten hasten.utils hasten.logging hasten.hooks hasten.big_modeling
