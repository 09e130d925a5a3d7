"""A checkpoint's JSON files (config.json, tokenizer files, hf_quant_config.json) read as one JSON object,
every way one can be broken named with the file in a CheckpointError."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError


def read_object(f: Path) -> dict:
    """The JSON object in file `f`; a CheckpointError naming `f` when it cannot be read, is not UTF-8,
    not JSON, nested too deeply to parse, or not an object."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{f} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise CheckpointError(f"{f} nests its JSON too deeply") from None
    except OSError as e:
        raise CheckpointError(f"{f} cannot be read: {e.strerror}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{f} must hold a JSON object, got a {type(data).__name__}")
    return data
