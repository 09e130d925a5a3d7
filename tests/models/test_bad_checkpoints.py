"""Broken checkpoints raise CheckpointError naming the file or tensor, never a raw parser error."""

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbuffer import KVBufferError, demo_checkpoint
from kvbuffer.errors import CheckpointError
from kvbuffer.models.loader import load_checkpoint, read_config


@pytest.fixture
def ckpt(tmp_path):
    """A copy of the demo checkpoint to break."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy(demo_checkpoint() / name, tmp_path / name)
    return tmp_path


def _header(path):
    """(header length, header dict) of a safetensors file."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n])


def test_checkpoint_error_is_a_kvbuffer_error():
    assert issubclass(CheckpointError, KVBufferError) and issubclass(CheckpointError, ValueError)


CONFIGS = {
    "malformed json": ('{"model_type": "qwen3_5_text",', "config.json is not valid JSON"),
    "a list": ("[1, 2, 3]", "config.json must hold a JSON object, got a list"),
    "a string": ('"qwen"', "must hold a JSON object, got a str"),
    "not utf-8": (b"\xff\xfe{}", "config.json is not UTF-8"),
}


@pytest.mark.parametrize("case", CONFIGS, ids=list(CONFIGS))
def test_bad_config_names_the_file(ckpt, case):
    text, msg = CONFIGS[case]
    (ckpt / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=msg):
        read_config(ckpt)


def _truncate(f):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _zero_bytes(f):
    f.write_bytes(b"")


def _bad_header_length(f):
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 2**40) + raw[8:])


def _garbage_header(f):
    n, _ = _header(f)
    raw = bytearray(f.read_bytes())
    raw[8:8 + n] = b"!" * n
    f.write_bytes(bytes(raw))


def _flipped_header_byte(f):
    """A flipped byte in the header's JSON (the offsets no longer add up, or it no longer parses)."""
    raw = bytearray(f.read_bytes())
    raw[9] ^= 0xFF
    f.write_bytes(bytes(raw))


def _directory(f):
    f.unlink()
    f.mkdir()


FILES = {"truncated": _truncate, "zero bytes": _zero_bytes, "header length past the end": _bad_header_length,
         "garbage header": _garbage_header, "flipped header byte": _flipped_header_byte, "a directory": _directory}


@pytest.mark.parametrize("case", FILES, ids=list(FILES))
def test_unreadable_weights_name_the_file(ckpt, case):
    FILES[case](ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(ckpt)


def test_flipped_data_bytes_that_make_a_nan_are_caught(ckpt):
    """Two bytes of one bf16 weight set to 0xFF (a NaN): the check names the tensor."""
    f = ckpt / "model.safetensors"
    n, header = _header(f)
    start = 8 + n + header["model.norm.weight"]["data_offsets"][0]
    raw = bytearray(f.read_bytes())
    raw[start:start + 2] = b"\xff\xff"
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="tensor model.norm.weight in .*model.safetensors has non-finite"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weights_are_named(ckpt, bad):
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.norm.weight"][3] = bad
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor model.norm.weight .*non-finite"):
        load_checkpoint(ckpt)


def test_a_tensor_in_two_files_is_an_error(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    (ckpt / "model.safetensors").unlink()
    save_file({k: tensors[k] for k in names[:half + 1]}, str(ckpt / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[half:]}, str(ckpt / "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match=f"tensor {names[half]} is in both model-00001-of-00002.safetensors "
                                              "and model-00002-of-00002.safetensors"):
        load_checkpoint(ckpt)


def test_split_checkpoint_without_overlap_loads(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    (ckpt / "model.safetensors").unlink()
    save_file({k: tensors[k] for k in names[::2]}, str(ckpt / "a.safetensors"))
    save_file({k: tensors[k] for k in names[1::2]}, str(ckpt / "b.safetensors"))
    whole = load_checkpoint(demo_checkpoint())
    split = load_checkpoint(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), split.state_dict().values()))


@pytest.mark.parametrize("field, value", [("hidden_size", "160"), ("hidden_size", -4), ("model_type", ["qwen"]),
                                          ("layer_types", None), ("vocab_size", 2.5)],
                         ids=["size as a string", "negative size", "model_type a list", "layer_types null",
                              "vocab_size float"])
def test_config_values_of_the_wrong_type(ckpt, field, value):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, **{field: value})))
    with pytest.raises(CheckpointError, match="config.json|model_type"):
        load_checkpoint(ckpt)
