# Two entry points for a fresh machine: `make run` (the main job: the default emulated-network
# experiment, which needs root) and `make test` (the suite).
# Both bootstrap .venv on first use and are quick once it exists.
PYTHON ?= python3
VENV ?= .venv
# On a machine without CUDA, install this CPU build first so the project's `torch>=2.1`
# range is already satisfied and pip does not fetch a multi-GB CUDA build (ENVIRONMENT.md).
# Override with `make TORCH_SPEC= test` to let pip choose.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo torch==2.13.0)
# DeepSpeed's own 1-bit compressed allreduce is the reference the tests compare against. Its
# newer releases dropped it; 0.17.6 builds without ops and without fetching torch again only
# with DS_BUILD_OPS=0 and --no-build-isolation (ENVIRONMENT.md), so it is installed here.
DEEPSPEED_SPEC ?= deepspeed==0.17.6
BIN := $(VENV)/bin
STAMP := $(VENV)/.bitcomm-installed
# Triton as the GPU image's torch ships it (torch 2.11's CUDA build pins 3.6.0), in a folder of
# its own beside the venv's packages: tests/test_bench_kernels.py compiles every kernel with it
# too (no GPU needed), since it rejects code that the dev extra's Triton and the interpreter
# accept.
TRITON_GPU_SPEC ?= triton==3.6.0
TRITON_GPU := $(VENV)/triton-gpu

.PHONY: run test bench lint clean gpu-wheels

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(BIN)/python -m pip install -q "$(TORCH_SPEC)")
	$(BIN)/python -m pip install -q -e ".[dev,mpi,jit,plots,experiments]"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-build-isolation "$(DEEPSPEED_SPEC)"
	touch $(STAMP)

# --overwrite: `make run` regenerates results/default each time it is run.
run: $(STAMP)
	$(BIN)/bitcomm run experiment --overwrite

test: $(STAMP) $(TRITON_GPU)/.installed
	$(BIN)/python -m ruff check bitcomm tests
	$(BIN)/python -m pytest -q

$(TRITON_GPU)/.installed: $(STAMP)
	rm -rf $(TRITON_GPU)
	$(BIN)/python -m pip install -q --no-deps --target $(TRITON_GPU) "$(TRITON_GPU_SPEC)"
	touch $@

lint: $(STAMP)
	$(BIN)/python -m ruff check bitcomm tests

# The packages a lent GPU machine's image lacks, as wheels for its Python (3.12, x86-64), for
# tools/gpu-check.sh there: that machine cannot reach a package index. Versions: this venv's.
# pytest-xdist (with execnet) lets the script run the CUDA tests in processes.
GPU_PYTHON ?= 3.12
gpu-wheels: $(STAMP)
	rm -f .whl/*.whl  # a Triton cache copied there stays
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl \
	  $$($(BIN)/python -m pip list --format=freeze | grep -i -E '^(bitarray|mpich|mpi4py|pytest-xdist|execnet|pytest-timeout)==')

clean:
	rm -rf $(VENV) build *.egg-info
