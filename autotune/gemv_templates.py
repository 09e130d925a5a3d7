"""The projection kernels' tuning loads, where `kvbuffer tune` reports what a timed call moves: their
inputs and references live with their family (kvbuffer.kernels.gemv)."""

from kvbuffer.kernels.gemv import EXPERTS_TIMED, GROUPED_ROWS, GROUPED_TIMED, grouped_counts

__all__ = ["EXPERTS_TIMED", "GROUPED_ROWS", "GROUPED_TIMED", "grouped_counts"]
