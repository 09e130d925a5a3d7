# Convenience targets; each is one command you can also type yourself.
PY ?= python3

.PHONY: install test test-gpu lint bench

install:            ## the README's install command
	$(PY) -m pip install "torch==2.13.0" -e ".[test,gpu]"

test:               ## the README's test command (CPU; GPU tests skip without CUDA)
	$(PY) -m pytest -q tests

test-gpu:           ## only the kernel tests that need a GPU
	$(PY) -m pytest -q -m gpu tests

bench:              ## the standard benchmarks on a CUDA GPU (pip install -e ".[gpu,bench]"); results in benchmarks/results/
	kvbuffer bench gdn
	kvbuffer bench mamba2
	kvbuffer bench decode --preset qwen3.5-9b --profile-batch 256
	kvbuffer bench decode --preset nemotron-3-nano --batches 1,64,256,512
	kvbuffer bench spec --preset qwen3.5-9b --setting equal
	kvbuffer bench spec --preset qwen3.5-9b --setting capacity
