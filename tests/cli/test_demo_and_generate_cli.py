"""The bundled demo model, `kvbuffer generate`, and the training script's fast GDN forward."""

import importlib.util
import logging
import pathlib
import re

import pytest
import torch
from click.testing import CliRunner

import kvbuffer
from kvbuffer.cli.generate import _quiet_item_graph_breaks
from kvbuffer.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO = pathlib.Path(kvbuffer.__file__).resolve().parent / "demo"


def _train_module():
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts" / "train_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_checkpoint_ships_with_the_package():
    for name in ("config.json", "model.safetensors", "kvbuffer_tokenizer.json"):
        assert (DEMO / name).is_file(), name
    assert (DEMO / "model.safetensors").stat().st_size < 4 * 2**20  # small enough to ship


def test_generate_cli_runs_the_demo_model():
    result = CliRunner().invoke(main, ["generate", "--prompt", "The ", "--max-new-tokens", "40", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    text = result.output.split("[")[0]
    assert text.startswith("The ") and len(text) > 10
    assert "tok/s" in result.output


def test_generate_cli_batch_and_modes_agree(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("In Python, \nA list \n")
    outs = []
    for mode in ("kvbuffer", "recurrent"):
        r = CliRunner().invoke(main, ["generate", "--prompts-file", str(prompts), "--max-new-tokens", "24",
                                      "--mode", mode, "--device", "cpu"])
        assert r.exit_code == 0, r.output
        outs.append(r.output.split("[")[0])
    assert outs[0] == outs[1]  # greedy text is the same with and without the buffer


def test_generate_cli_rejects_a_bad_model_dir(tmp_path):
    r = CliRunner().invoke(main, ["generate", "--model", str(tmp_path), "--prompt", "x"])
    assert r.exit_code != 0 and "not a checkpoint directory" in r.output


def test_training_forward_matches_transformers_chunked_gdn():
    import inspect

    import tests.support.hf_models  # noqa: F401  (blocks the fast-kernel packages before transformers loads)
    from transformers.models.qwen3_5 import modeling_qwen3_5

    chunked = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)  # the torch fallback itself

    train = _train_module()
    g = torch.Generator().manual_seed(0)
    B, T, Hk, Hv, K, V = 2, 37, 2, 4, 8, 6
    q, k = torch.randn(B, T, Hk, K, generator=g), torch.randn(B, T, Hk, K, generator=g)
    v = torch.randn(B, T, Hv, V, generator=g)
    beta, gg = torch.rand(B, T, Hv, generator=g), -torch.rand(B, T, Hv, generator=g)
    ours, s1 = train.parallel_gated_delta_rule(q, k, v, gg, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref, s2 = chunked(q, k, v, gg, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert float((ours - ref).abs().max()) < 1e-5 and float((s1 - s2).abs().max()) < 1e-5


def test_generate_cli_speculative_matches_plain():
    args = ["generate", "--prompt", "The built-in function ", "--max-new-tokens", "32", "--device", "cpu"]
    plain = CliRunner().invoke(main, args)
    spec = CliRunner().invoke(main, args + ["--speculative", "ngram", "--draft-tokens", "3"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.output.split("[")[0] == plain.output.split("[")[0]
    assert "ngram drafts accepted" in spec.output


@pytest.mark.slow  # torch.compile from a cold Inductor cache: minutes on a 2-core CPU
def test_generate_cli_compiled_matches_plain():
    """--compile runs the forwards under torch.compile, saying so on stderr while it compiles, without
    dynamo's `Tensor.item()` graph-break warning; greedy text is the uncompiled one's."""
    args = ["generate", "--prompt", "def ", "--max-new-tokens", "12", "--device", "cpu", "--dtype", "float32"]
    plain = CliRunner().invoke(main, args)
    dynamo = logging.getLogger(_quiet_item_graph_breaks.LOGGER)
    seen = _Records()
    dynamo.addHandler(seen)
    try:
        compiled = CliRunner().invoke(main, args + ["--compile"])
    finally:
        dynamo.removeHandler(seen)
    assert plain.exit_code == 0 and compiled.exit_code == 0, compiled.output
    assert compiled.stdout == plain.stdout
    assert len(re.findall(r"kvbuffer: compiling the decode step .*\.\.\. done in \d+\.\ds", compiled.stderr)) == 1, \
        compiled.stderr
    assert not [r for r in seen.records if "Tensor.item()" in str(r.msg)]
    assert not dynamo.filters, "the filter outlived the command"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_the_graph_break_filter_drops_only_the_item_warning():
    def record(msg):
        return logging.LogRecord(_quiet_item_graph_breaks.LOGGER, logging.WARNING, __file__, 1, msg, (), None)

    quiet = _quiet_item_graph_breaks()
    assert not quiet.filter(record("Graph break from `Tensor.item()`, consider setting:\n..."))
    assert quiet.filter(record("Graph break from `Tensor.tolist()`"))
    assert quiet.filter(record("recompiling the forward: cache limit reached"))


def test_generate_cli_error_after_the_echoed_prompt_starts_a_new_line():
    result = CliRunner().invoke(main, ["generate", "--prompt", "The quick brown fox", "--max-len", "4",
                                       "--device", "cpu"])
    assert result.exit_code == 1
    assert result.stdout == "The quick brown fox\n"
    assert "exceed max_len=4" in result.stderr
