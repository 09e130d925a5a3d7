# Convenience targets; each is one command you can also type yourself.
PY ?= python3
# where torch comes from: its CPU build by default; `make install TORCH_INDEX=` takes pip's own index
# (on Linux the CUDA build)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install test test-slow test-all test-gpu lint bench

install:            ## the README's install commands
	$(PY) -m pip install "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e ".[test,gpu]"

test:               ## the README's test command (CPU; GPU tests skip without CUDA; `slow` tests left out)
	$(PY) -m pytest -q tests

test-slow:          ## only the tests marked slow (most need TileLang, nvcc and g++), one process per core
	$(PY) -m pytest -q -n auto -m slow tests

test-all:           ## the full suite: the README's test command with the slow tests
	$(PY) -m pytest -q --run-slow tests

test-gpu:           ## only the kernel tests that need a GPU
	$(PY) -m pytest -q -m gpu tests

bench:              ## the standard benchmarks on a CUDA GPU (pip install -e ".[gpu,bench]"); results in benchmarks/results/
	kvbuffer bench gdn
	kvbuffer bench mamba2
	kvbuffer bench decode --preset qwen3.5-9b --profile-batch 256
	kvbuffer bench decode --preset nemotron-3-nano --batches 1,64,256,512
	kvbuffer bench spec --preset qwen3.5-9b --setting equal
	kvbuffer bench spec --preset qwen3.5-9b --setting capacity
	kvbuffer bench prefill
	kvbuffer bench prefill --what e2e --preset qwen3.5-9b --prompt-lens 4096,16384,32768
