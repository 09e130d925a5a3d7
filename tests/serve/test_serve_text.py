"""Special tokens in a choice's text (skip_special_tokens, as vLLM: on by default, streamed too) and
chat templates given to the server (--chat-template: a file or an inline Jinja string)."""

import pytest

from kvbuffer.detokenize import IncrementalDetokenizer, special_ids
from kvbuffer.serve.chat import ChatTemplate, chat_prompt
from kvbuffer.serve.stream import ChoiceText
from kvbuffer.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE whose chat markers are added special tokens, as in Qwen's tokenizer (where
    transformers' all_special_ids names only the eos-like ones)."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<|im_start|>", "<|im_end|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, 日本語"] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _streamed(text: ChoiceText, ids) -> list[str]:
    return [text.push([t]) for t in ids] + [text.finish()]


def test_special_tokens_leave_the_text_by_default_and_stay_when_asked(tokenizer):
    ids = tokenizer.encode("<|im_start|>hello 日本<|im_end|> world<eos>")
    markers = {tokenizer.convert_tokens_to_ids(t) for t in ("<eos>", "<|im_start|>", "<|im_end|>")}
    assert special_ids(tokenizer) >= markers
    skipped = _streamed(ChoiceText(tokenizer, tokenizer.encode("hi"), []), ids)
    assert "".join(skipped) == tokenizer.decode(ids, skip_special_tokens=True) == "hello 日本 world"
    kept = _streamed(ChoiceText(tokenizer, tokenizer.encode("hi"), [], skip_special_tokens=False), ids)
    assert "".join(kept) == tokenizer.decode(ids) == "<|im_start|>hello 日本<|im_end|> world<eos>"
    assert not any("\ufffd" in p for p in skipped + kept)  # whole characters either way


def test_a_stop_string_may_span_a_kept_special_token(tokenizer):
    ids = tokenizer.encode("hello<|im_end|> world")
    text = ChoiceText(tokenizer, [], ["o<|im_end|>"], skip_special_tokens=False)
    assert "".join(_streamed(text, ids)) == "hell" and text.stopped


def test_the_byte_tokenizer_has_only_its_eos_as_special():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert special_ids(tok) == frozenset() and detok.add(256) == "" and detok.flush() == ""


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
RENDERED = "<system>Be brief.\n<user>Hi\n<assistant>"


def test_a_template_inline_or_in_a_file_renders_for_both_kinds_of_tokenizer(tmp_path, tokenizer):
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    for template in (ChatTemplate.load(TEMPLATE), ChatTemplate.load(str(tmp_path / "chat.jinja"))):
        assert chat_prompt(ByteTokenizer(), MESSAGES, template) == RENDERED  # kvbuffer's own Jinja sandbox
        assert chat_prompt(tokenizer, MESSAGES, template) == RENDERED  # transformers' apply_chat_template
    assert chat_prompt(ByteTokenizer(), MESSAGES) == "system: Be brief.\nuser: Hi\nassistant: "  # no template


def test_template_mistakes_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        ChatTemplate.load(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="line 1"):
        ChatTemplate.load("{% for m in messages %}")
    failing = ChatTemplate.load("{{ raise_exception('only user messages') }}")
    with pytest.raises(ValueError, match="only user messages"):
        chat_prompt(ByteTokenizer(), MESSAGES, failing)
    with pytest.raises(ValueError, match="chat template"):
        chat_prompt(ByteTokenizer(), MESSAGES, ChatTemplate.load("{{ messages[0]['content'] | nosuchfilter }}"))
