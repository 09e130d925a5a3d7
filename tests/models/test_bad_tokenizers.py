"""Broken tokenizer files are a CheckpointError naming the file, never a bare JSONDecodeError,
AttributeError or KeyError from deep inside a parser."""

import json

import pytest

from kvbuffer.errors import CheckpointError
from kvbuffer.tokenizer import BYTE_TOKENIZER_FILE, ByteTokenizer, load_tokenizer


def _word_level_tokenizer() -> str:
    """A small valid tokenizer.json (word level, whitespace split)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


BYTES_CASES = {
    "not json": ("{", "is not valid JSON"),
    "a list": ("[1]", "must hold a JSON object, got a list"),
    "not utf-8": (b"\xff\xfe", "is not UTF-8"),
    "unknown type": ('{"type": "sentencepiece"}', "unknown tokenizer type 'sentencepiece'"),
    "no type": ("{}", "unknown tokenizer type None"),
    "eos a string": ('{"type": "bytes", "eos_token_id": "x"}', "eos_token_id must be an integer"),
    "eos out of range": ('{"type": "bytes", "eos_token_id": 300}', "eos_token_id must be an integer"),
    "eos a bool": ('{"type": "bytes", "eos_token_id": true}', "eos_token_id must be an integer"),
    "deep": ("[" * 10000 + "]" * 10000, "too deeply"),
}


@pytest.mark.parametrize("case", BYTES_CASES, ids=list(BYTES_CASES))
def test_a_broken_byte_tokenizer_file_is_named(tmp_path, case):
    text, msg = BYTES_CASES[case]
    (tmp_path / BYTE_TOKENIZER_FILE).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=msg) as e:
        load_tokenizer(tmp_path)
    assert BYTE_TOKENIZER_FILE in str(e.value)


def test_a_valid_byte_tokenizer_loads(tmp_path):
    ByteTokenizer(7).save(tmp_path)
    assert load_tokenizer(tmp_path).eos_token_id == 7
    assert load_tokenizer(tmp_path / "nothing here") is None


HF_CASES = {
    "tokenizer.json not json": ({"tokenizer.json": "{"}, "tokenizer.json is not valid JSON"),
    "tokenizer.json a list": ({"tokenizer.json": "[]"}, "tokenizer.json must hold a JSON object"),
    "tokenizer.json wrong model": ({"tokenizer.json": '{"model": 5}'}, "tokenizer.json"),
    "tokenizer.json no model": ({"tokenizer.json": "{}"}, "tokenizer.json"),
    "tokenizer_config.json not json": ({"tokenizer.json": None, "tokenizer_config.json": "{'a': 1}"},
                                       "tokenizer_config.json is not valid JSON"),
    "tokenizer_config.json a string": ({"tokenizer.json": None, "tokenizer_config.json": '"x"'},
                                       "tokenizer_config.json must hold a JSON object"),
    "unknown tokenizer class": ({"tokenizer_config.json": '{"tokenizer_class": "NoSuchTokenizerFast"}'},
                                "tokenizer_config.json"),
}


@pytest.mark.parametrize("case", HF_CASES, ids=list(HF_CASES))
def test_a_broken_transformers_tokenizer_file_is_named(tmp_path, case):
    pytest.importorskip("transformers")
    files, msg = HF_CASES[case]
    for name, text in files.items():
        (tmp_path / name).write_text(_word_level_tokenizer() if text is None else text)
    with pytest.raises(CheckpointError, match=msg):
        load_tokenizer(tmp_path)


def test_a_valid_transformers_tokenizer_loads(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "tokenizer.json").write_text(_word_level_tokenizer())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "[UNK]"}))
    assert load_tokenizer(tmp_path).encode("a b", add_special_tokens=False) == [1, 2]
