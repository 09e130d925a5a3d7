"""Benchmarks that any CUDA user runs from the installed package (`kvbuffer bench ...`).

- timing: the one timing method (many launches in one CUDA graph, median of replays, inputs
  rotated past L2) used by every benchmark and by the tuner, and a profiler cross-check.
- kernels: what the GDN and Mamba-2 kernel benchmarks share (pools, correctness gate, rows);
  gdn and mamba2 hold each family's inputs, references and peer kernel.
- e2e, drafter: decode and speculative decoding through the engine, with a drafter of controlled
  acceptance; plot: the figures.

Importing this package needs neither a GPU nor matplotlib (nor torch); running a benchmark needs CUDA.
"""

KERNEL_BATCHES = (1, 4, 16, 64, 256, 1024)  # the kernel benchmarks' batches unless told otherwise
