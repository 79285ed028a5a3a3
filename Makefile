# Set-up is part of each target: `make train` or `make test` on a fresh machine does everything,
# into the environment of $(PY) (an activated venv's python3, or PY=/path/to/venv/bin/python).
# `make train` installs the core only (torch, numpy, safetensors, pyyaml, packaging); `make test`
# adds the test extra (transformers, accelerate, deepspeed, torchao, trackers) on top.
PY ?= python3
NPROC ?= 2
# What was installed is remembered per environment: a stamp named after $(PY)'s sys.prefix and when
# its interpreter file was made, so a new venv (even one made again at the same path) gets its own
# install in a clone where another environment already has one.
ENV_ID := $(shell $(PY) -c "import hashlib, os, sys; \
	print(hashlib.sha1(f'{sys.prefix} {os.lstat(sys.executable).st_mtime_ns}'.encode()).hexdigest()[:12])")
CORE_STAMP := .install-core-$(ENV_ID)
TEST_STAMP := .install-test-$(ENV_ID)
# The `hasten` console script pip installed for $(PY), not whichever `hasten` is first on PATH.
HASTEN = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_path('scripts'))")/hasten

.PHONY: install install-test train test smoke-min bench docs
install: $(CORE_STAMP)
install-test: $(TEST_STAMP)

# torch is installed first and on its own so that the package's `torch>=2.7` is already met:
# on the CI/dev machines `torch==2.13.0` resolves to a local CPU wheel, never to CUDA wheels.
$(CORE_STAMP): pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $@

$(TEST_STAMP): $(CORE_STAMP) pyproject.toml
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[test]'
	touch $@

train: $(CORE_STAMP)
	$(HASTEN) launch --cpu --num_processes $(NPROC) examples/train.py

# smoke-min first, so that pytest's summary stays the last line of `make test`.
test: $(TEST_STAMP) smoke-min
	$(PY) -m pytest -q

# hasten on the oldest torch pyproject.toml allows (`torch>=X.Y` -> X.Y.0), in a small venv of its own
# (built once, ~0.8 GB download, no CUDA packages: tools/min_torch_venv.sh), a few minutes.
MIN_TORCH ?= $(shell sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml).0
MIN_VENV ?= $(HOME)/.cache/hasten/min-torch-$(MIN_TORCH)
smoke-min:
	@rc=0; PY=$(PY) tools/min_torch_venv.sh $(MIN_VENV) $(MIN_TORCH) || rc=$$?; \
	if [ $$rc -eq 3 ]; then exit 0; elif [ $$rc -ne 0 ]; then exit $$rc; fi; \
	PYTHONPATH=$(CURDIR)/src $(MIN_VENV)/bin/python tests/smoke_min_torch.py

bench: $(CORE_STAMP)
	$(PY) bench/overhead.py

# The API reference, from the docstrings: open site/api/index.html.
docs: $(CORE_STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	$(PY) -m pdoc -o site/api hasten hasten.utils hasten.logging hasten.hooks hasten.big_modeling
