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

EDITABLE := $(VENV)/.tf_gba-editable

# Installs the package in editable mode once (this compiles the op libraries). PYTHONWARNINGS:
# setuptools warns on every editable install about folders named like the package in the working
# directory (this checkout is one); nothing to act on.
$(EDITABLE): setup.py $(STAMP)
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(EDITABLE)

# Builds the op libraries in place (tf_gba/ops/_*_ops*.so); only changed sources are recompiled.
build: $(EDITABLE)
	$(PY) setup.py -q build_ext --inplace

# Each test module runs in its own process (tests/module_process.py), so the DTS modules get their
# logical CPUs configured before TensorFlow starts and no module sees another's stopped clusters;
# up to TF_GBA_TEST_JOBS of them at once. The 15 slowest tests are listed at the end.
test: build
	$(PY) -m pytest -q --durations=15 tests $(PYTEST_ARGS)

# The main job: DeepFM on synthetic data with GBA, 1 PS + 4 worker processes on 127.0.0.1, under
# transient stragglers (every step 4x slower with p=0.2) plus worker 0 persistently 2x slower.
DEMO_ARGS ?= --mode=gba --model=deepfm --data=synthetic --num_ps=1 --num_workers=4 \
	--stragglers=transient:0.2:4+persistent:2@0 --steps=1600 --log_every=200 --eval_every=800 \
	--model_dir=runs/demo

demo: build
	rm -rf runs/demo
	$(PY) examples/train.py $(DEMO_ARGS)

bench: build
	$(PY) -m benchmarks.buffer_bandwidth
	$(PY) -m benchmarks.mode_qps $(BENCH_ARGS)

clean:
	rm -rf build *.egg-info tf_gba/ops/_*_ops*.so tf_gba/ops/_build_info.py

# Bazel, offline (docs/building.md): Debian's bazel-bootstrap (Bazel 4.2.3) is installed when no
# bazel is on PATH; @local_config_tf takes TensorFlow from the venv. The libraries land in
# bazel-bin/custom_ops/<area>/_<area>_ops.so, where tf_gba's loader looks.
.PHONY: bazel-install bazel-build bazel-test cuda-build gpu-functor-check
BAZEL ?= bazel
BAZEL_ARGS ?=
SUDO ?= $(shell [ "$$(id -u)" = 0 ] || echo sudo)

bazel-install:
	@command -v $(BAZEL) >/dev/null 2>&1 || \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q bazel-bootstrap || \
	  { $(SUDO) apt-get update -q && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q bazel-bootstrap; }

bazel-build: $(STAMP) bazel-install
	PYTHON_BIN_PATH=$(abspath $(PY)) $(BAZEL) build $(BAZEL_ARGS) //...

bazel-test: $(STAMP) bazel-install
	PYTHON_BIN_PATH=$(abspath $(PY)) $(BAZEL) test $(BAZEL_ARGS) //...

# The op libraries with their CUDA kernels (nvcc; no GPU needed to build), into build/cuda so the
# CPU build in place stays as it is. Use them with TF_GBA_OPS_DIR=build/cuda/tf_gba/ops.
cuda-build: $(STAMP)
	TF_NEED_CUDA=1 $(PY) setup.py -q build_ext --build-lib build/cuda

# The GBA buffers' GPU functors against host references, as a program that needs only the CUDA
# driver (no TensorFlow): build/gpu_check/buffer_functors_gpu_check [--time] on any GPU machine.
gpu-functor-check: $(STAMP)
	$(PY) setup.py -q build_gpu_check
