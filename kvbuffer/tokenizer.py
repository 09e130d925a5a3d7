"""Tokenizers: transformers' for real checkpoints, and a tiny byte-level one for the demo model.

The demo checkpoint that kvbuffer trains itself ships `kvbuffer_tokenizer.json`, so generating
text needs no download and no transformers install.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTE_TOKENIZER_FILE = "kvbuffer_tokenizer.json"


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
    """The checkpoint's tokenizer, or None when it ships none."""
    path = Path(path)
    own = path / BYTE_TOKENIZER_FILE
    if own.is_file():
        spec = json.loads(own.read_text())
        if spec.get("type") != "bytes":
            raise ValueError(f"{own}: unknown tokenizer type {spec.get('type')!r}")
        return ByteTokenizer(spec.get("eos_token_id", 256))
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError(f"{path} has a transformers tokenizer; install transformers to use it") from e
        return AutoTokenizer.from_pretrained(str(path))
    return None
