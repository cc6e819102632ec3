# One entry point for users and CI. `make test` and `make demo` each set up what they need:
# a virtualenv in .venv (if missing), the pinned dependencies, and the compiled op libraries.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tf_gba-deps

.PHONY: all venv build test demo bench clean

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): requirements.txt | $(PY)
	$(PY) -m pip install -q -r requirements.txt
	touch $(STAMP)

venv: $(STAMP)

# Builds the op libraries in place (tf_gba/ops/_*_ops*.so) and installs the package in editable mode.
build: $(STAMP)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) setup.py -q build_ext --inplace

test: build
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

demo: build
	$(PY) examples/train.py $(DEMO_ARGS)

bench: build
	$(PY) -m benchmarks.run_all $(BENCH_ARGS)

clean:
	rm -rf build *.egg-info tf_gba/ops/_*_ops*.so tf_gba/ops/_build_info.py
