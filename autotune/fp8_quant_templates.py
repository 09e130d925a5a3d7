"""The FP8 activation quantizer's tuning load, where `kvbuffer tune` reports what a timed call moves: its
inputs and reference live with its family (kvbuffer.kernels.fp8_ops)."""

from kvbuffer.kernels.fp8_ops import TIMED_ROWS

__all__ = ["TIMED_ROWS"]
