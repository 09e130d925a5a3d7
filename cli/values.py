"""The comma-separated option parsers (kvbuffer.option_values), for the commands in this package."""

from kvbuffer.option_values import numbers, positive_ints

__all__ = ["numbers", "positive_ints"]
