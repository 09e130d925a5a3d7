"""Typed, range-checked readers of config.json fields: the model configs read every field through
them, so a value of the wrong type, out of range or absent where required is a CheckpointError at
load naming the field, never an error (or a silent misreading) at the first forward.

JSON types are taken as they are: an int field takes a JSON integer (not 2.0, not true, not "2"),
a float field a JSON number (not true, not "x"), a bool field true or false (not "no", not 0). A
field set to null is absent: it takes its default (required fields have none).
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import CheckpointError

SIZE_MAX = 2 ** 31 - 1  # a size or count beyond int32 indexes no kernel
_REQUIRED = object()


class ConfigFields:
    """The fields of one JSON object of a config.json (`where`: its path there, for the messages)."""

    def __init__(self, data: object, where: str = "config.json"):
        if not isinstance(data, dict):
            named = "" if where == "config.json" else f": {where}"
            raise CheckpointError(f"config.json{named} must be a JSON object, got {_kind(data)}")
        self.data, self.where = data, where

    def _name(self, key: str) -> str:
        return key if self.where == "config.json" else f"{self.where}.{key}"

    def error(self, key: str, want: str, value: object) -> CheckpointError:
        return CheckpointError(f"config.json: {self._name(key)} must be {want}, got {_shown(value)}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = _REQUIRED) -> Any:
        """The value of `key` (null counts as absent), or `default`; a CheckpointError when required."""
        value = self.data.get(key)
        if value is None:
            if default is _REQUIRED:
                raise CheckpointError(f"config.json lacks {self._name(key)!r}")
            return default
        return value

    def int(self, key: str, default: Any = _REQUIRED, *, lo: int = 1, hi: int = SIZE_MAX) -> int:
        """An integer in [lo, hi] (sizes and counts: [1, 2**31 - 1])."""
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        if not _is_int(value) or not lo <= value <= hi:
            raise self.error(key, f"an integer in [{lo}, {hi}]", value)
        return value

    def float(self, key: str, default: Any = _REQUIRED, *, hi: float = math.inf) -> float:
        """A finite number > 0 and at most `hi`."""
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        try:
            number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        except OverflowError:  # an integer too large for a float
            number = math.nan
        if not (math.isfinite(number) and 0 < number <= hi):
            upper = "" if hi == math.inf else f" and <= {hi}"
            raise self.error(key, f"a finite number > 0{upper}", value)
        return number

    def bool(self, key: str, default: Any = _REQUIRED) -> bool:
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        if not isinstance(value, bool):
            raise self.error(key, "true or false", value)
        return value

    def choice(self, key: str, choices, default: Any = _REQUIRED) -> str:
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        if not isinstance(value, str) or value not in choices:
            raise self.error(key, f"one of {sorted(choices)}", value)
        return value

    def str_list(self, key: str, choices, default: Any = _REQUIRED, *, max_len: int = 4096) -> tuple[str, ...]:
        """A non-empty list (at most max_len) of strings from `choices`."""
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        if not isinstance(value, list) or not 1 <= len(value) <= max_len \
                or not all(isinstance(v, str) and v in choices for v in value):
            raise self.error(key, f"a list of 1 to {max_len} of {sorted(choices)}", value)
        return tuple(value)

    def int_list(self, key: str, default: Any = _REQUIRED, *, lo: int = 0, hi: int = SIZE_MAX) -> tuple[int, ...]:
        """A list of integers in [lo, hi] (may be empty)."""
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) and lo <= v <= hi for v in value):
            raise self.error(key, f"a list of integers in [{lo}, {hi}]", value)
        return tuple(value)

    def ids(self, key: str, vocab_size: int, default: Any = ()) -> tuple[int, ...]:
        """A token id or a list of them, each in [0, vocab_size); null or absent: `default`."""
        if not self.has(key):
            return default
        value = self.data[key]
        items = value if isinstance(value, list) else [value]
        if not all(_is_int(v) and 0 <= v < vocab_size for v in items):
            raise self.error(key, f"a token id or a list of them, each in [0, {vocab_size}) (vocab_size)", value)
        return tuple(items)

    def layer_count(self, n: int, list_key: str) -> None:
        """`num_hidden_layers`, when given, must be `n`: the length of the layer list `list_key`."""
        if self.has("num_hidden_layers"):
            value = self.data["num_hidden_layers"]
            if not _is_int(value) or value != n:
                raise self.error("num_hidden_layers", f"{n}, the length of {self._name(list_key)}", value)

    def obj(self, key: str) -> "ConfigFields":
        """A nested object (absent or null: an empty one)."""
        return ConfigFields(self.raw(key, {}), self._name(key))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _shown(value: object) -> str:
    """The value, or its kind when its text would be long (a deeply nested list)."""
    text = repr(value) if isinstance(value, (int, float, str, bool, type(None))) else None
    return text if text is not None and len(text) <= 60 else _kind(value)
