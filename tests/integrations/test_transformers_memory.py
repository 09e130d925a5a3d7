"""enable(model, chunk_size=...) plans the buffers' bytes before anything is allocated: a chunk size
whose buffers cannot fit in the model device's free memory is a ValueError naming chunk_size, at
enable() (one sequence) and again when a generation makes a batch's buffers."""

import pytest
import torch

import kvbuffer.integrations.transformers as kvb
from kvbuffer.integrations import transformers_layers
from kvbuffer.engine import validate
from tests.support.hf_models import make_hf_model


@pytest.fixture(scope="module", params=["qwen3_5_text", "nemotron_h"])
def model(request):
    return make_hf_model(request.param).eval()


@pytest.mark.parametrize("chunk_size", [10**9, 10**12])
def test_a_chunk_size_that_cannot_fit_is_refused_at_enable(model, chunk_size):
    with pytest.raises(ValueError, match=rf"^chunk_size={chunk_size}: the caches would need [\d,]+ B \(buffers "
                                         rf"[\d,]+ B\), more than the [\d,]+ B free on cpu$"):
        kvb.enable(model, chunk_size=chunk_size)
    assert kvb.enabled_layers(model) == []  # nothing changed


def test_a_batch_whose_buffers_cannot_fit_is_refused_before_they_are_made(model, monkeypatch):
    kvb.enable(model, chunk_size=4)
    try:
        ids = torch.randint(1, 97, (3, 5), generator=torch.Generator().manual_seed(0))
        monkeypatch.setattr(validate, "free_memory", lambda device: 1000)
        def refuse(*args, **kwargs):
            raise AssertionError("buffers were made before their bytes were checked")

        monkeypatch.setattr(transformers_layers, "LayerBuffers", refuse)
        with pytest.raises(ValueError, match=r"chunk_size=4: the caches would need [\d,]+ B .* more than the 1,000 B"):
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    finally:
        kvb.disable(model)


def test_disable_takes_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        kvb.disable("qwen3.5")
