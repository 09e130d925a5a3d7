"""Incremental detokenization never emits a broken character, and stop strings cut the stream."""

import pytest

from kvbuffer.detokenize import IncrementalDetokenizer, StopMatcher
from kvbuffer.tokenizer import ByteTokenizer

TEXTS = ["日本語のテキスト", "plain ascii, then émoji 🎉 and ß", "a", "  leading spaces\nnew line"]


def _stream(tokenizer, ids, prompt=()):
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A byte-level BPE (transformers) with a tiny vocabulary, so that CJK characters and emoji
    span several tokens, as they do in real checkpoints' tokenizers."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 3 + ["the quick brown fox jumps over the lazy dog"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.mark.parametrize("text", TEXTS, ids=["cjk", "mixed", "one-char", "spaces"])
def test_byte_tokens_stream_whole_characters(text):
    tok = ByteTokenizer()
    pieces = _stream(tok, tok.encode(text) + [tok.eos_token_id])
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(bool(p) for p in pieces) == len(text)  # one piece per character, none split


def test_one_token_at_a_time_would_break_characters():
    """Why the module exists: decoding each byte token alone prints U+FFFD."""
    tok = ByteTokenizer()
    assert "\ufffd" in "".join(tok.decode([t]) for t in tok.encode("日本"))


@pytest.mark.parametrize("text", TEXTS, ids=["cjk", "mixed", "one-char", "spaces"])
def test_transformers_tokenizer_streams_what_a_full_decode_gives(bpe_tokenizer, text):
    ids = bpe_tokenizer.encode(text)
    assert any("\ufffd" in bpe_tokenizer.decode([t]) for t in ids) or text.isascii()
    pieces = _stream(bpe_tokenizer, ids + [bpe_tokenizer.eos_token_id])
    assert "".join(pieces) == bpe_tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_prompt_context_keeps_the_continuation_exact(bpe_tokenizer):
    prompt, completion = bpe_tokenizer.encode("the quick "), bpe_tokenizer.encode("brown fox 日本")
    pieces = _stream(bpe_tokenizer, completion, prompt)
    assert "".join(pieces) == bpe_tokenizer.decode(prompt + completion)[len(bpe_tokenizer.decode(prompt)):]


def test_an_incomplete_character_at_the_end_is_flushed_as_a_full_decode_would():
    tok = ByteTokenizer()
    ids = tok.encode("ok日")[:-1]  # the last character cut in half
    assert "".join(_stream(tok, ids)) == tok.decode(ids)


@pytest.mark.parametrize("deltas, stops, sent, stopped", [
    (["hello wor", "ld. bye"], ["world"], "hello ", True),
    (["ab", "c", "d"], ["cd"], "ab", True),
    (["no stop ", "here"], ["zz"], "no stop here", False),
    (["x"], [], "x", False),
    (["one", "\n\ntwo"], ["\n\n", "two"], "one", True),
], ids=["across-pieces", "held-back-prefix", "none", "no-stops", "earliest-wins"])
def test_stop_strings_cut_the_stream(deltas, stops, sent, stopped):
    m, out, hit = StopMatcher(stops), "", False
    for d in deltas:
        piece, hit = m.push(d)
        out += piece
        if hit:
            break
    if not hit:
        out += m.flush()
    assert (out, hit) == (sent, stopped)


def test_generate_cli_streams_what_a_full_decode_gives():
    """`kvbuffer generate` printed one token at a time (日本���); now its stream is the full decode."""
    from click.testing import CliRunner

    from kvbuffer import LLM, demo_checkpoint
    from kvbuffer.cli.main import main

    prompt = "日本語と"
    out = LLM(str(demo_checkpoint()), device="cpu").generate([prompt], max_new_tokens=24)[0]
    r = CliRunner().invoke(main, ["generate", "--prompt", prompt, "--max-new-tokens", "24", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert r.stdout == prompt + out.text + "\n"
