# Entry points that work on a fresh machine, in any order:
#   make install  pip install --no-build-isolation . with the interpreter below (what the README says to run)
#   make test     installs what is missing, builds the extension in place, runs the test suite
#   make bench    checks the node (python -m torch_sdma.check), then the all-gather and exchange benchmarks (sdma
#                 against the inner backend) over every local GPU, or 2 CPU ranks; writes results/ with its plots
# Each step says what it does in one line, the build what it compiles and about how long; the compiler's output goes
# to build/build.log, shown when the build fails. Every build from one checkout shares its objects (setup.py).
#
# The interpreter: $(PYTHON) (python3 on PATH: an activated venv) when it imports torch, used as it is. Otherwise a
# venv $(VENV) is made with torch $(TORCH_VERSION) from $(TORCH_INDEX) (PyPI's CUDA-13 build unless set, so that the
# GPU code is compiled even where no GPU is; TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU build).

SHELL         := /bin/bash
.SHELLFLAGS   := -o pipefail -c
PYTHON        ?= python3
VENV          ?= .venv
TORCH_VERSION ?= 2.14.1
TORCH_INDEX   ?=
PY            := $(shell $(PYTHON) -c "import torch" >/dev/null 2>&1 && echo $(PYTHON) || echo $(VENV)/bin/python)
JOBS          ?= $(shell nproc)
PYTEST_ARGS   ?=
# The linters' versions are pinned: a new release may format differently.
RUFF_VERSION         ?= 0.15.12
CLANG_FORMAT_VERSION ?= 18.1.8
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
# Never let a test or benchmark touch NVLink multicast (it can take a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE := 0
export TORCH_SYMM_MEM_DISABLE_MULTICAST := 1
export NVSHMEM_DISABLE_NVLS := 1

.PHONY: all deps install build test lint lint-deps format fresh-clone hip-check bench gpu-tests gpu-frameworks clean soak

all: build

deps:
	@if [ "$(PY)" = "$(VENV)/bin/python" ]; then \
	  [ -x $(VENV)/bin/python ] || { \
	    echo "make: $(PYTHON) has no torch: creating the venv $(VENV) (PYTHON=<interpreter with torch> to use yours)"; \
	    $(PYTHON) -m venv $(VENV); }; \
	  $(PY) -c "import torch" >/dev/null 2>&1 || { \
	    echo "make: installing torch $(TORCH_VERSION) into $(VENV) ($(if $(TORCH_INDEX),from $(TORCH_INDEX),CUDA build, 5.5 GB): minutes, once)"; \
	    $(PY) -m pip install -q --progress-bar off $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==$(TORCH_VERSION)"; }; \
	fi
	@$(PY) -c "import pytest, numpy" >/dev/null 2>&1 || { \
	  echo "make: installing pytest, numpy"; $(PY) -m pip install -q --progress-bar off pytest numpy; }
	@command -v ninja >/dev/null || [ -x $(dir $(PY))ninja ] || { \
	  echo "make: installing ninja (none on PATH)"; $(PY) -m pip install -q --progress-bar off ninja; }

# The README's install, into the interpreter the other targets use, as a user runs it (without the PYTHONPATH set
# above). It builds in build/ too: the objects are shared with `make build`, and the package's metadata stays there
# (setup.py), out of the checkout on PYTHONPATH.
install: deps
	@echo "make: pip install --no-build-isolation . into $(PY) with $(JOBS) jobs"
	@env -u PYTHONPATH MAX_JOBS=$(JOBS) $(PY) -m pip install -q --progress-bar off --no-build-isolation .

# Quiet: the compiler's command lines go to build/build.log, shown only when the build fails.
build: deps
	@mkdir -p build
	@echo "make: building torch_sdma._C for $(PY) with $(JOBS) jobs (log: build/build.log)"
	@MAX_JOBS=$(JOBS) $(PY) setup.py -q build_ext --inplace 2>&1 | tee build/build.log | { grep '^torch_sdma: ' || true; } \
	  || { tail -n 40 build/build.log; echo "make: the build failed; the whole log is build/build.log"; exit 1; }

test: build
	@echo "make: running the tests (pytest tests; CPU ranks, the GPU suites skip without two GPUs)"
	$(PY) -m pytest tests $(PYTEST_ARGS)

# Style: ruff for Python (ruff.toml), clang-format for C++ (.clang-format). `make format` applies both.
CXX_FILES = $(shell git ls-files 'csrc/*.cpp' 'csrc/*.hpp' 'tests/cpp/*.cpp')
lint-deps: deps
	@$(PY) -m ruff --version 2>/dev/null | grep -q " $(RUFF_VERSION)$$" || $(PY) -m pip install -q "ruff==$(RUFF_VERSION)"
	@$(PY) -c "import clang_format" 2>/dev/null && $(dir $(PY))clang-format --version | grep -q "version $(CLANG_FORMAT_VERSION)" \
	  || $(PY) -m pip install -q "clang-format==$(CLANG_FORMAT_VERSION)"

lint: lint-deps
	$(PY) -m ruff check .
	$(dir $(PY))clang-format --dry-run --Werror $(CXX_FILES)

format: lint-deps
	$(PY) -m ruff check --fix .
	$(dir $(PY))clang-format -i $(CXX_FILES)

# The README's steps on another torch, in a fresh clone of this checkout's HEAD with a venv of its own holding torch
# $(FRESH_TORCH): the install, torch-sdma-check, make test and make bench, in that order. A clone, not this checkout:
# the tests put the checkout first on the path (tests/soak_faults.py) or hand it to their children (PYTHONPATH), so
# an extension built in place here for one torch must never be where another torch's tests look. CI runs it with
# 2.13.0, the oldest torch it can install (TORCH_INDEX, as above, picks the index torch comes from).
FRESH_TORCH ?= 2.13.0
FRESH_DIR   := $(CURDIR)/build/fresh-torch$(FRESH_TORCH)
FRESH_MAKE  := env -u PYTHONPATH $(MAKE) -C $(FRESH_DIR) PYTHON=$(FRESH_DIR)/.venv/bin/python
fresh-clone:
	@echo "make: a fresh clone of HEAD in $(FRESH_DIR), with torch $(FRESH_TORCH) in its .venv"
	@rm -rf $(FRESH_DIR) && git clone -q . $(FRESH_DIR) && $(PYTHON) -m venv $(FRESH_DIR)/.venv
	@$(FRESH_DIR)/.venv/bin/python -m pip install -q --progress-bar off $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) \
	  "torch==$(FRESH_TORCH)"
	$(FRESH_MAKE) install
	cd / && env -u PYTHONPATH $(FRESH_DIR)/.venv/bin/torch-sdma-check
	$(FRESH_MAKE) test
	$(FRESH_MAKE) bench

# The HIP build of the GPU layer, compiled host-only as AMD's platform against Debian's HIP headers
# (libamdhip64-dev, HIP 5.2; installed when missing, which needs root) and torch's, warnings as errors. It shows
# that csrc/gpu/gpu_api_hip.cpp compiles; no AMD GPU runs it here. g++, not hipcc: a ROCm build of torch compiles
# extension .cpp files with the host compiler and -D__HIP_PLATFORM_AMD__=1 too. torch's headers go in as system
# headers: their warnings are not this check's to fail on.
HIP_CXX ?= g++
hip-check: deps
	@[ -f /usr/include/hip/hip_runtime_api.h ] || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq --no-install-recommends libamdhip64-dev >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends libamdhip64-dev >/dev/null; }; }
	@mkdir -p build
	$(HIP_CXX) -std=c++20 -D__HIP_PLATFORM_AMD__=1 -DUSE_ROCM=1 -Wall -Wextra -Werror -Icsrc \
	  $$($(PY) -c "from torch.utils import cpp_extension as c; print(' '.join('-isystem ' + p for p in c.include_paths()))" 2>/dev/null) \
	  -c csrc/gpu/gpu_api_hip.cpp -o build/gpu_api_hip.o

NGPU  = $(shell $(PY) -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
NPROC = $(if $(filter 0,$(NGPU)),2,$(NGPU))
# One thread per rank unless the caller chose: torchrun otherwise warns that it set it.
BENCH_ENV = OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}
bench: build
	@$(PY) -c "import matplotlib" >/dev/null 2>&1 || { \
	  echo "make: installing matplotlib (the benchmark's plots)"; $(PY) -m pip install -q --progress-bar off matplotlib; }
	@echo "make: checking this node with $(NPROC) ranks (python -m torch_sdma.check)"
	$(BENCH_ENV) $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) -m torch_sdma.check --skip-busbw
	@echo "make: the all-gather benchmark with $(NPROC) ranks, one line per size (results/)"
	$(BENCH_ENV) $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) examples/bench_allgather.py \
	  --out-dir results
	@echo "make: the exchange benchmark with $(NPROC) ranks (all_to_all_single, broadcast, gather, scatter; results/)"
	$(BENCH_ENV) $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) examples/bench_exchange.py \
	  --out-dir results

# The randomized all-gather soak (tests/soak_allgather.py): a rank per local GPU, or two ranks sharing the one GPU or
# the CPU; its options go in SOAK_ARGS, e.g. make soak SOAK_ARGS="--calls 100000 --seed 7".
soak: build
	$(PY) -m torch.distributed.run --standalone --nproc_per_node $(if $(filter 0 1,$(NGPU)),2,$(NGPU)) \
	  tests/soak_allgather.py $(SOAK_ARGS)

# The fault soak (tests/soak_faults.py): two ranks, on the GPU where there is one (both on it), else the CPU; one fault
# an episode, e.g. make soak-faults SOAK_ARGS="--faults 40 --seed 7".
.PHONY: soak-faults
soak-faults: build
	$(PY) tests/soak_faults.py $(SOAK_ARGS)

# On a GPU machine, in two steps; logs go to $(LOGS). On 2x H200 the groups but direct took 440 s five at once (two of
# them cut at 260 s), direct 165 s alone after them; GPU_SUITE_ONLY runs a part of them (tests/README.md).
LOGS ?= results
gpu-tests: build
	mkdir -p $(LOGS)
	bash tests/run_gpu_suite.sh $(LOGS) $(PY) 2>&1 | tee $(LOGS)/gpu_tests.log
	$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) examples/bench_allgather.py --out-dir $(LOGS) 2>&1 | tee $(LOGS)/bench.log

gpu-frameworks: build
	mkdir -p $(LOGS)
	bash examples/install_framework_wheels.sh
	$(PY) examples/compare_frameworks.py --frameworks fsdp2,zero3,megatron --out-dir $(LOGS) 2>&1 | tee $(LOGS)/frameworks.log
	$(PY) -m pytest tests/test_frameworks_gpu.py -v -rA 2>&1 | tee $(LOGS)/frameworks_tests.log

clean:
	rm -rf build torch_sdma/*.so results
