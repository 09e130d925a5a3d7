"""Kernel templates, custom ops, the tuner and artifacts: compiled on the CPU, emulated, checked against the reference."""
