"""EngineConfig: one place for the engine's defaults, help texts and checks; the CLI's engine options
are generated from it, and `LLM(model, config)` equals `LLM(model, **fields)`."""

import dataclasses

import click
import pytest
from click.testing import CliRunner

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.cli.main import main
from kvbuffer.defaults import DEFAULT_CHUNK_SIZE, MAX_DRAFT_TOKENS
from kvbuffer.engine.config import EngineConfig, SpeculativeConfig
from kvbuffer.runtime.caches import fill_after


def test_every_field_has_a_default_and_a_help_text():
    for cls in (EngineConfig, SpeculativeConfig):
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING and f.metadata["help"], f.name


def test_the_config_is_frozen_and_takes_a_speculative_dict():
    config = EngineConfig(speculative={"method": "ngram", "num_draft_tokens": 2})
    assert config.speculative == SpeculativeConfig("ngram", 2) and config.fed == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_len = 4


@pytest.mark.parametrize("kwargs, err, msg", [
    (dict(max_batch=0), ValueError, "max_batch must be >= 1, got 0"),
    (dict(mode="fast"), ValueError, "mode must be one of"),
    (dict(unbuffered_rows=-1), ValueError, "unbuffered_rows must be >= 0"),
    (dict(gemv="yes"), ValueError, "gemv must be True, False or 'auto'"),
    (dict(chunk_sise=8), TypeError, "unknown engine option 'chunk_sise'"),
], ids=["max_batch", "mode", "unbuffered_rows", "gemv", "unknown field"])
def test_one_check_per_field(kwargs, err, msg):
    with pytest.raises(err, match=msg):
        EngineConfig.from_kwargs(**kwargs)


def test_a_config_and_keyword_arguments_build_the_same_engine():
    config = EngineConfig(device="cpu", chunk_size=4, max_batch=2, max_len=64)
    a = LLM(str(demo_checkpoint()), config)
    b = LLM(str(demo_checkpoint()), device="cpu", chunk_size=4, max_batch=2, max_len=64)
    assert a.config == b.config and a.limits == b.limits
    assert a.limits.chunk_size == 4 and a.limits.max_requests == 2 and a.limits.draft_tokens == 0
    c = LLM(str(demo_checkpoint()), config, max_batch=3)  # keyword arguments replace the config's fields
    assert c.limits.max_requests == 3 and c.config.chunk_size == 4


def test_stats_are_a_snapshot():
    llm = LLM(str(demo_checkpoint()), device="cpu", chunk_size=4, max_batch=2, max_len=64)
    before = llm.stats
    assert (before.running, before.waiting, before.request_slots_free) == (0, 0, 2) and before.drafts is None
    llm.generate([[5, 6, 7]], max_new_tokens=2)
    assert llm.stats == before


def _options(*path: str) -> dict[str, tuple]:
    command = main
    for name in path:
        command = command.commands[name]
    return {p.opts[0]: (p.help, p.type.name, p.default) for p in command.params if isinstance(p, click.Option)}


def test_commands_share_one_spelling_and_help_per_engine_option():
    generate, serve, decode = _options("generate"), _options("serve"), _options("bench", "decode")
    for option in ("--mode", "--max-len", "--device", "--dtype", "--speculative", "--draft-tokens", "--compile",
                   "--cuda-graphs", "--chunk-size"):
        assert generate[option] == serve[option], option
    assert decode["--cuda-graphs"] == generate["--cuda-graphs"]
    assert f"else {DEFAULT_CHUNK_SIZE}" in generate["--chunk-size"][0] and generate["--chunk-size"][2] is None
    assert decode["--chunk-size"][2] == DEFAULT_CHUNK_SIZE  # the benchmarks fix C
    assert serve["--max-batch"][2] == 64  # the server's own default


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bad_engine_option_is_a_usage_error_on_every_command(command):
    for args, text in ((["--device", "banana"], "device must be 'cpu', 'cuda' or 'cuda:N'"),
                       (["--speculative", "ngram", "--draft-tokens", str(MAX_DRAFT_TOKENS + 1)],
                        f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]"),
                       (["--chunk-size", "0"], "chunk_size must be >= 1")):
        r = CliRunner().invoke(main, [command, *args])
        assert r.exit_code == 2 and text in r.output, r.output


@pytest.mark.parametrize("fill, count, whole, want", [(3, 1, False, 0), (3, 1, True, 0), (0, 9, False, 1),
                                                      (2, 3, True, 0), (2, 3, False, 1), (1, 2, True, 3)])
def test_one_buffer_fill_rule(fill, count, whole, want):
    """A prefill flushes at every multiple of C and keeps the rest; a commit folds a buffer that reached C."""
    assert fill_after(fill, count, 4, whole=whole) == want
