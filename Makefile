# Convenience targets; each is one command you can also type yourself.
PY ?= python3

.PHONY: install test test-gpu lint

install:            ## the README's install command
	$(PY) -m pip install "torch==2.13.0" -e ".[test,gpu]"

test:               ## the README's test command (CPU; GPU tests skip without CUDA)
	$(PY) -m pytest -q tests

test-gpu:           ## only the kernel tests that need a GPU
	$(PY) -m pytest -q -m gpu tests

duplicates:         ## repeated code blocks in this change
	duplicates --change
