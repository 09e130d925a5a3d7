"""A text prompt that UTF-8 cannot hold (a lone surrogate) is a ValueError naming the prompt, before
anything is encoded or admitted; the engine runs on unchanged."""

import pytest

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.engine.validate import check_text
from tests.support.pool_slots import all_free


@pytest.mark.parametrize("prompts, what", [("ab\ud800cd", "prompt 0"), (["ok", "\udfff"], "prompt 1"),
                                           (["x", "y\ud83d"], "prompt 1")])
def test_a_lone_surrogate_is_a_value_error_naming_the_prompt(prompts, what):
    llm = LLM(str(demo_checkpoint()), device="cpu", max_batch=2, max_len=32, chunk_size=4)
    want = llm.generate("ab", max_new_tokens=3)[0].token_ids
    with pytest.raises(ValueError, match=f"{what} is not valid text: .* is a lone surrogate") as e:
        llm.generate(prompts, max_new_tokens=3)
    assert type(e.value) is ValueError
    assert all_free(llm) and llm.generate("ab", max_new_tokens=3)[0].token_ids == want


def test_check_text_passes_text_and_names_the_index():
    check_text("naïve 🙂 text", "prompt")
    with pytest.raises(ValueError, match=r"'\\ud800' at index 3"):
        check_text("abc\ud800", "prompt")
