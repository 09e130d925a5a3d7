"""A published-format FP8 checkpoint directory is exactly `kvbuffer generate --model DIR` and `LLM(DIR)`:
nothing to convert first; on the CPU it generates what the dequantized model generates, in both modes."""

import shutil

import pytest
from click.testing import CliRunner

from kvbuffer import LLM, demo_checkpoint, presets
from kvbuffer.models.loader import load_checkpoint, read_config
from kvbuffer.models.quant.write import dequantize_checkpoint, write_checkpoint

TOKENIZER_FILES = ("kvbuffer_tokenizer.json", "generation_config.json")


def _with_tokenizer(path):
    for name in TOKENIZER_FILES:
        if (demo_checkpoint() / name).is_file():
            shutil.copy(demo_checkpoint() / name, path / name)
    return path


@pytest.fixture(scope="module", params=["block", "modelopt"])
def demo_fp8(request, tmp_path_factory):
    """The demo model in FP8 (block 32 x 32: its widths are 160, 448) and its dequantized twin."""
    root = tmp_path_factory.mktemp(request.param)
    model = load_checkpoint(demo_checkpoint())
    fp8 = write_checkpoint(model, read_config(demo_checkpoint()), root / "fp8", request.param, block=(32, 32))
    return _with_tokenizer(fp8), _with_tokenizer(dequantize_checkpoint(fp8, root / "dequantized"))


def _cli_text(path, mode):
    from kvbuffer.cli.main import main

    result = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", "The ", "--max-new-tokens", "24",
                                       "--device", "cpu", "--mode", mode])
    assert result.exit_code == 0, result.output
    return result.output.split("[")[0]


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
def test_generate_cli_loads_an_fp8_directory(demo_fp8, mode):
    fp8, dequantized = demo_fp8
    text = _cli_text(fp8, mode)
    assert text.startswith("The ") and text == _cli_text(dequantized, mode)


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-nemotron"])
def test_preset_writer_fp8_checkpoints_run_end_to_end(tmp_path, name):
    """presets.write_checkpoint(fp8=True): the family's format, loaded by LLM(DIR) on the CPU, greedy equal
    to the dequantized model's."""
    path = presets.write_checkpoint(name, tmp_path / "fp8", fp8=True)
    assert (path / "hf_quant_config.json").is_file() == (presets.get(name).fp8_format == "modelopt")
    prompts = [[1, 2, 3, 4], [7]]
    got = LLM(path, device="cpu").generate(prompts, max_new_tokens=5)
    want = LLM(dequantize_checkpoint(path, tmp_path / "dequantized"), device="cpu").generate(prompts, max_new_tokens=5)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
