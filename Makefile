# Two commands do all the set-up on a fresh machine: `make test` and `make bench`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch_xla 2.9.0 is the newest release and pins torch 2.9.0; torchvision 0.24.0 matches it
# (its nms is the reference our nms tests compare against).
PINS   := torch==2.9.0 torch_xla==2.9.0 torchvision==0.24.0
DEPS   := transformers peft numpy pytest pybind11 ninja tqdm matplotlib ensemble-boxes ruff

export PJRT_DEVICE ?= CPU

.PHONY: venv install test test-torch bench bench-kernels check-cuda clean

$(VENV)/.deps: Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PIP) install --quiet $(PINS) $(DEPS)
	touch $@

venv: $(VENV)/.deps

$(VENV)/.installed: $(VENV)/.deps pyproject.toml setup.py
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q tests

# The tests that do not need torch_xla (which pins torch 2.9) under another torch, in a venv of its own
# (accel supports torch 2.9 to 2.13):  make test-torch TORCH=2.13.0+cpu   (see tools/test_torch.sh)
TORCH ?= 2.13.0+cpu

test-torch:
	PYTHON=$(PYTHON) bash tools/test_torch.sh $(TORCH)

bench: install
	$(PY) benchmarks/bert_base.py

bench-kernels: install
	$(PY) benchmarks/kernels.py

check-cuda: install
	$(PY) tools/check_cuda_compiles.py

clean:
	rm -rf build *.egg-info $(VENV)
