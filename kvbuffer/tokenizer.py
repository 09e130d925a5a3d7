"""Tokenizers: transformers' for real checkpoints, and a tiny byte-level one for the demo model.

The demo checkpoint that kvbuffer trains itself ships `kvbuffer_tokenizer.json`, so generating
text needs no download and no transformers install.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError
from .jsonfile import read_object

BYTE_TOKENIZER_FILE = "kvbuffer_tokenizer.json"
HF_FILES = ("tokenizer.json", "tokenizer_config.json")  # a transformers tokenizer (either is enough)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-text token."""

    def __init__(self, eos_token_id: int = 256):
        self.eos_token_id = eos_token_id
        self.vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, path: Path) -> None:
        (Path(path) / BYTE_TOKENIZER_FILE).write_text(json.dumps({"type": "bytes", "eos_token_id": self.eos_token_id}))


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when it ships none. A file that is there but broken (not
    JSON, not an object, fields of the wrong kind, a tokenizer transformers cannot build) is a
    CheckpointError naming it."""
    path = Path(path)
    own = path / BYTE_TOKENIZER_FILE
    if own.is_file():
        spec = read_object(own)
        if spec.get("type") != "bytes":
            raise CheckpointError(f"{own}: unknown tokenizer type {spec.get('type')!r} (kvbuffer's is 'bytes')")
        eos = spec.get("eos_token_id", 256)
        if not isinstance(eos, int) or isinstance(eos, bool) or not 0 <= eos <= 256:
            raise CheckpointError(f"{own}: eos_token_id must be an integer in [0, 256], got {eos!r}")
        return ByteTokenizer(eos)
    files = [path / name for name in HF_FILES if (path / name).is_file()]
    if not files:
        return None
    for f in files:
        read_object(f)
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(f"{path} has a transformers tokenizer; install transformers to use it") from e
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
        names = ", ".join(f.name for f in files)
        raise CheckpointError(f"{path}: transformers cannot build a tokenizer from {names}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
